"""One way to shard and run a user's model (``Choice``): what ``plan`` searches, ranks and prints as code."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import StrategyGroups

# The engine's default bucket limit, repeated here so the plan package reads no engine internals for it
# (checked equal to fullshard._core.settings' in tests/test_plan_any_model.py).
DEFAULT_BUCKET_BYTES = 2**20
CHOICE_STRATEGIES = ("full", "grad-op", "hybrid", "no-shard")


@dataclass(frozen=True)
class Choice(StrategyGroups):
    """A sharding configuration of one step on ``world_size`` ranks.

    Attributes:
        world_size: ranks.
        strategy: ``full`` (``fully_shard``, resharded after forward), ``grad-op``
            (``reshard_after_forward=False``), ``hybrid`` (a 2-D mesh: shard within groups of
            ``hybrid_shard_size``, all-reduce across them), ``no-shard`` (``replicate``).
        hybrid_shard_size: the shard group of ``hybrid``.
        reshard_to: ``full`` only: ``reshard_after_forward=reshard_to`` (an int: after forward
            each block keeps its parameters split over that many ranks; backward gathers there).
        micro_batch: samples per rank and forward/backward.
        accumulation: micro-batches per optimizer step (gradients reduced after each).
        mixed_precision: the compute dtype (gathered parameters), gradients reduced in fp32; None: fp32.
        cpu_offload: shards, gradients and optimizer states in host memory.
        checkpointing: activation checkpointing on every block.
        all_gather_dtype: quantized all-gather codes (``torch.int8``) or None.
        ranks_per_node: for the links' bandwidths (intra- or inter-node).
        device: ``cuda`` or ``cpu``.
        dtype: the parameters' own dtype (shards, optimizer states).
    """

    world_size: int
    strategy: str = "full"
    hybrid_shard_size: int | None = None
    reshard_to: int | None = None
    micro_batch: int = 1
    accumulation: int = 1
    mixed_precision: torch.dtype | None = None
    cpu_offload: bool = False
    checkpointing: bool = False
    all_gather_dtype: torch.dtype | None = None
    ranks_per_node: int = 8
    device: str = "cuda"
    dtype: torch.dtype = torch.float32
    optimizer_states: int = 2
    all_gather_block_size: int = 128
    all_gather_bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def __post_init__(self) -> None:
        if self.strategy not in CHOICE_STRATEGIES:
            raise ValueError(f"Choice expects strategy in {CHOICE_STRATEGIES} but got {self.strategy!r}")
        if self.strategy == "hybrid" and (self.hybrid_shard_size is None or self.world_size % self.hybrid_shard_size):
            raise ValueError(
                f"Choice expects a hybrid_shard_size that divides world_size {self.world_size} but got "
                f"{self.hybrid_shard_size}"
            )
        if self.reshard_to is not None and (self.strategy != "full" or self.world_size % self.reshard_to):
            raise ValueError(
                f"Choice expects reshard_to only with strategy 'full' and dividing world_size {self.world_size}, "
                f"but got {self.reshard_to} with {self.strategy!r}"
            )

    def hybrid_shard_group(self) -> int:
        return self.hybrid_shard_size or self.world_size

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.mixed_precision or self.dtype

    @property
    def gradient_reduce_dtype(self) -> torch.dtype:
        return self.dtype if self.mixed_precision is not None else self.compute_dtype

    @property
    def samples_per_step(self) -> int:
        """Samples per rank and optimizer step."""
        return self.micro_batch * self.accumulation

    def label(self) -> str:
        """A short name for tables: ``full/raf=2 mb4x2 bf16 ac offload int8``."""
        strategy = self.strategy
        if self.strategy == "hybrid":
            strategy = f"hybrid{self.hybrid_shard_size}"
        if self.reshard_to is not None:
            strategy += f"/raf={self.reshard_to}"
        parts = [strategy, f"mb{self.micro_batch}" + (f"x{self.accumulation}" if self.accumulation > 1 else "")]
        if self.mixed_precision is not None:
            parts.append(str(self.mixed_precision).removeprefix("torch.").replace("bfloat16", "bf16"))
        if self.checkpointing:
            parts.append("ac")
        if self.cpu_offload:
            parts.append("offload")
        if self.all_gather_dtype is not None and self.shard_size > 1:
            parts.append(str(self.all_gather_dtype).removeprefix("torch."))
        return " ".join(parts)
