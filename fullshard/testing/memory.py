"""Per-rank memory of one training step on CPU, for checking ``fullshard plan``'s prediction: see
[Note: Measured step memory on CPU] (``training/tensor_peak.py``). Two warm-up steps come first
(optimizer states; the forward order that prefetch follows), then the least peak of three steps.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .._core import comm
from .._core.mesh import default_mesh, hybrid_mesh
from .._core.step import get_state
from ..all_gather_buckets import set_all_gather_bucket_size
from ..all_gather_quantization import set_all_gather_quantization
from ..api import (
    AllGatherQuantization,
    CPUOffload,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
)
from ..fully_shard import fully_shard
from ..models import ModelArgs, Transformer, TransformerBlock
from ..replicate import replicate
from ..training.tensor_peak import TensorPeak

__all__ = ["measure_step", "storage_bytes", "profiled_step_peak", "warmed_step_peak"]


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local tensors)."""
    storages = {}
    for tensor in tensors:
        storage = getattr(tensor, "_local_tensor", tensor).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def profiled_step_peak(step: Callable[[], None]) -> tuple[int, list[comm.CommRecord]]:
    """(peak bytes of live tensors above the start, collective records) of one call of ``step``."""
    with comm.record_comms() as records, TensorPeak() as peak:
        step()
    return peak.rise, records


def warmed_step_peak(
    step: Callable[[], None], model: nn.Module, optim: torch.optim.Optimizer, count_buffers: bool = False
) -> tuple[int, int, dict[str, int]]:
    """Two warm-up calls of ``step`` (lazy init, optimizer states), then three profiled ones:
    (peak: the live parameters, optimizer states and, with ``count_buffers``, buffers before
    plus the least rise; late release: the spread of the three rises (see [Note: Measured step
    memory on CPU]); bytes by collective in one step)."""
    step()
    step()
    gc.collect()
    states = [t for state in optim.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    buffers = list(model.buffers()) if count_buffers else []
    before = storage_bytes([*model.parameters(), *buffers, *states])
    peaks, records = zip(*(profiled_step_peak(step) for _ in range(3)))
    comm_bytes: dict[str, int] = {}
    for record in records[-1]:
        comm_bytes[record.op] = comm_bytes.get(record.op, 0) + record.nbytes
    return before + min(peaks), max(peaks) - min(peaks), comm_bytes


_WRAPPER_STRATEGIES = {
    "full": "FULL_SHARD",
    "grad-op": "SHARD_GRAD_OP",
    "no-shard": "NO_SHARD",
    "hybrid": "HYBRID_SHARD",
}


def measure_step(
    args: ModelArgs,
    batch: int,
    strategy: str,
    bf16: bool,
    ranks_per_node: int,
    front_end: str = "fully_shard",
    offload: bool = False,
    all_gather_dtype: torch.dtype | None = None,
    all_gather_bucket_bytes: int | None = None,
) -> dict:
    """This rank's peak bytes in a training step of the reference Transformer (one
    unit per block plus the root, as ``fullshard plan`` models it) and what the
    step communicated, through ``front_end`` (``fully_shard``, the FSDP1
    ``wrapper`` with ``use_orig_params=True``, or ``wrapper-flat``: its flat
    parameters, ``PlanConfig.flat_params``), with the shards offloaded to the host or not, and weights
    gathered as ``all_gather_dtype`` codes when it is set, and small units prefetched together up to
    ``all_gather_bucket_bytes`` (None: the default; see [Note: Gather buckets]). See [Note:
    Measured step memory on CPU]."""
    torch.manual_seed(0)
    base = Transformer(args)
    # CPU explicitly: the default mesh would be CUDA's on a machine with a GPU.
    mesh = hybrid_mesh("cpu", ranks_per_node) if strategy == "hybrid" else default_mesh("cpu", "fully_shard")
    if front_end in ("wrapper", "wrapper-flat"):
        model: nn.Module = _wrap(base, mesh, strategy, bf16, offload, flat=front_end == "wrapper-flat")
    else:
        mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()
        policy = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
        for module in [*base.layers, base]:
            if strategy == "no-shard":
                replicate(module, mesh=mesh, mp_policy=mp, offload_policy=policy)
            else:
                # None: resharded after forward except the root, as fullshard train shards (and plan models)
                reshard = None if strategy != "grad-op" else False
                fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=policy)
        model = base
    if all_gather_dtype is not None:
        set_all_gather_quantization(model, AllGatherQuantization(dtype=all_gather_dtype))
    if all_gather_bucket_bytes is not None:
        set_all_gather_bucket_size(model, all_gather_bucket_bytes)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(args.vocab_size, (batch, args.max_seq_len), generator=generator)

    def step() -> None:  # model(...), as Transformer.loss does: the wrapper's forward is its __call__
        nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten()).backward()
        optim.step()
        optim.zero_grad()

    peak, late_release, comm_bytes = warmed_step_peak(step, model, optim)
    return {
        "peak": peak,
        "late_release": late_release,
        "comm": comm_bytes,
        "shard_numels": [_shard_numel(m) for m in [model, *base.layers]],
    }


def _wrap(model: Transformer, mesh: DeviceMesh, strategy: str, bf16: bool, offload: bool, flat: bool) -> nn.Module:
    """``model`` under the FSDP1 wrapper, one unit per block plus the root; ``flat``: with
    ``use_orig_params=False``, each unit one flat parameter in FSDP1's layout (see [Note: Flat
    layout] in _core/layout.py), else per-parameter rows."""
    from ..wrap import ModuleWrapPolicy
    from ..wrapper import FullyShardedDataParallel

    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    return FullyShardedDataParallel(
        model,
        sharding_strategy=ShardingStrategy[_WRAPPER_STRATEGIES[strategy]],
        device_mesh=mesh,
        auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
        mixed_precision=mp,
        cpu_offload=CPUOffload(offload_params=True) if offload else None,
        device_id=torch.device("cpu"),
        use_orig_params=not flat,
    )


def _shard_numel(module: nn.Module) -> int:
    """Elements of the unit's shard buffer on this rank (padded)."""
    state = get_state(module)
    if state is None or state.group is None:
        raise RuntimeError(f"measure_step expects {type(module).__name__} to be a fully_shard unit")
    return state.group.buffers.shard_buffer.numel()
