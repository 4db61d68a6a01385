"""What ``estimate`` is asked (``PlanConfig``) and what it answers (``Plan``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from .._core.settings import DEFAULT_ALL_GATHER_BUCKET_BYTES
from ..models.transformer import ModelArgs

STRATEGIES = ("full", "grad-op", "no-shard", "hybrid")


class StrategyGroups:
    """The groups a strategy implies, for ``PlanConfig`` and ``Choice`` (each says its hybrid shard size)."""

    strategy: str
    world_size: int

    def hybrid_shard_group(self) -> int:
        raise NotImplementedError

    @property
    def shard_size(self) -> int:
        """Ranks a parameter is split across."""
        if self.strategy == "no-shard":
            return 1
        return self.hybrid_shard_group() if self.strategy == "hybrid" else self.world_size

    @property
    def replicate_size(self) -> int:
        """Ranks holding the same shard (gradients all-reduced across them)."""
        return self.world_size // self.shard_size

    @property
    def reshard_after_forward(self) -> bool:
        return self.strategy in ("full", "hybrid")


class EngineSetup(Protocol):
    """What the engine's side of a step replay reads (``PlanConfig``, ``fullshard.plan.Choice``)."""

    @property
    def shard_size(self) -> int: ...
    @property
    def replicate_size(self) -> int: ...
    @property
    def reshard_after_forward(self) -> bool: ...
    @property
    def compute_dtype(self) -> torch.dtype: ...
    @property
    def gradient_reduce_dtype(self) -> torch.dtype: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def cpu_offload(self) -> bool: ...
    @property
    def device(self) -> str: ...
    @property
    def optimizer_states(self) -> int: ...
    @property
    def all_gather_dtype(self) -> torch.dtype | None: ...
    @property
    def all_gather_block_size(self) -> int: ...
    @property
    def all_gather_bucket_bytes(self) -> int: ...


@dataclass(frozen=True)
class PlanConfig(StrategyGroups):
    """One training setup of the reference ``Transformer``, one unit per block plus the root.

    Attributes:
        model: the Transformer's dimensions (see ``fullshard.models.get_preset``).
        world_size: number of ranks.
        strategy: ``full`` (FULL_SHARD: every unit resharded after forward but
            the root, which backward needs first), ``grad-op`` (SHARD_GRAD_OP: kept after forward),
            ``no-shard`` (NO_SHARD / ``replicate``: all-reduce), ``hybrid``
            (full within groups of ``ranks_per_node``, all-reduce across them).
        ranks_per_node: the shard group size of ``hybrid`` (capped at ``world_size``).
        batch_size: sequences per rank and step (``fullshard plan --batch`` is the global batch,
            split over ``world_size``; ``--batch-per-rank`` is this).
        seq_len: tokens per sequence (default: ``model.max_seq_len``).
        dtype: the parameters' dtype, hence the optimizer states' and the sharded gradients'.
        param_dtype: mixed precision: the dtype of gathered parameters and compute (None: ``dtype``).
        reduce_dtype: the dtype of gradient reduction (None: the compute dtype).
        optimizer_states: states per parameter (AdamW: 2).
        cpu_offload: sharded parameters, gradients and optimizer states live in host memory.
        all_gather_dtype: ``torch.int8`` or ``torch.float8_e4m3fn``: weights gathered as block-wise
            codes (``set_all_gather_quantization`` with its default rule: 2-D weights coded,
            norms, biases and embeddings exact); None: gathered in the compute dtype.
        all_gather_block_size: values per scale of those codes.
        flat_params: the FSDP1 wrapper with ``use_orig_params=False``: each unit's shard is a piece
            of its flat parameter (``ceil(numel / shard size)`` elements, padded once at the end)
            rather than every parameter's padded rows.
        all_gather_bucket_bytes: ``set_all_gather_bucket_size``: prefetched units gathered together
            in one all-gather up to this many gathered bytes (0: each alone; see [Note: Gather
            buckets] in ``fullshard/_core/gather/all_gather.py``).
        device: ``cuda`` or ``cpu``, where the step runs. Decides what some
            kernels allocate: AdamW (foreach on accelerators, one tensor at a
            time on CPU) and ``torch._chunk_cat`` (pads copies on CPU).
    """

    model: ModelArgs
    world_size: int
    strategy: str = "full"
    ranks_per_node: int = 8
    batch_size: int = 1
    seq_len: int | None = None
    dtype: torch.dtype = torch.float32
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    optimizer_states: int = 2
    cpu_offload: bool = False
    all_gather_dtype: torch.dtype | None = None
    all_gather_block_size: int = 128
    flat_params: bool = False
    all_gather_bucket_bytes: int = DEFAULT_ALL_GATHER_BUCKET_BYTES
    device: str = "cuda"

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"PlanConfig expects strategy in {STRATEGIES} but got {self.strategy!r}")
        if min(self.world_size, self.batch_size, self.ranks_per_node) < 1:
            raise ValueError(
                f"PlanConfig expects world_size, batch_size and ranks_per_node >= 1 but got "
                f"{self.world_size}, {self.batch_size} and {self.ranks_per_node}"
            )
        if self.strategy == "hybrid" and self.world_size % self.shard_size:
            raise ValueError(
                f"PlanConfig expects a world size that is a multiple of ranks_per_node for hybrid, "
                f"but got {self.world_size} and {self.ranks_per_node}"
            )
        if not 1 <= self.tokens_per_sequence <= self.model.max_seq_len:
            raise ValueError(f"PlanConfig expects seq_len in [1, {self.model.max_seq_len}] but got {self.seq_len}")
        if self.model.dim % self.model.n_heads:
            raise ValueError(
                f"PlanConfig expects dim divisible by n_heads but got {self.model.dim} and {self.model.n_heads}"
            )
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"PlanConfig expects device 'cuda' or 'cpu' but got {self.device!r}")

    def hybrid_shard_group(self) -> int:
        return min(self.ranks_per_node, self.world_size)

    @property
    def tokens_per_sequence(self) -> int:
        return self.seq_len if self.seq_len is not None else self.model.max_seq_len

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.param_dtype or self.dtype

    @property
    def gradient_reduce_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.compute_dtype


@dataclass(frozen=True)
class Plan:
    """The estimate for rank 0 (with padding, no rank holds more). Sizes in bytes.

    Attributes:
        config: what was estimated.
        num_params: parameters of the model (the tied output weight once).
        params: this rank's parameter shards (padded, as fullshard stores them).
        grads: this rank's gradient shards.
        optimizer_states: this rank's optimizer states.
        largest_unit: the largest gathered unit (padded, in the compute dtype).
        activations: what forward leaves for backward: saved tensors and the loss's log-softmax
            (the breakdown's "activations and their grads" is what is alive at the peak).
        peak: the most memory the step holds at once (on the device; the
            shards count only without CPU offload).
        peak_phase: when: ``forward``, ``backward`` or ``optimizer step``.
        peak_breakdown: what was alive at the peak, by category (see ``replay.py``).
        host: host memory under CPU offload (shards, gradients, optimizer states).
        comm: bytes per step by collective, counted as ``record_comms()`` counts them.
        comm_calls: collectives per step by kind.
    """

    config: PlanConfig
    num_params: int
    params: int
    grads: int
    optimizer_states: int
    largest_unit: int
    activations: int
    peak: int
    peak_phase: str
    peak_breakdown: dict[str, int]
    host: int
    comm: dict[str, int] = field(default_factory=dict)
    comm_calls: dict[str, int] = field(default_factory=dict)

    @property
    def comm_bytes(self) -> int:
        """Bytes per step through all collectives."""
        return sum(self.comm.values())
