"""One scenario's model under one framework: ``torch`` (the oracle) or ``ours``, same names, by import."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .models import Block, build
from .scenarios import Scenario

CPU = torch.device("cpu")


def api(lib: str) -> SimpleNamespace:
    """The public names of ``torch.distributed.fsdp`` or ``fullshard``."""
    if lib == "torch":
        from torch.distributed import fsdp as root
        from torch.distributed.fsdp import wrap
    else:
        import fullshard as root
        from fullshard import wrap
    names = (
        "FullyShardedDataParallel",
        "ShardingStrategy",
        "CPUOffload",
        "MixedPrecision",
        "StateDictType",
        "FullStateDictConfig",
        "ShardedStateDictConfig",
        "LocalStateDictConfig",
        "FullOptimStateDictConfig",
        "ShardedOptimStateDictConfig",
        "OptimStateKeyType",
        "fully_shard",
        "MixedPrecisionPolicy",
        "CPUOffloadPolicy",
    )
    ns = SimpleNamespace(**{n: getattr(root, n) for n in names}, lib=lib)
    ns.FSDP = ns.FullyShardedDataParallel
    ns.ModuleWrapPolicy = wrap.ModuleWrapPolicy
    return ns


_meshes: dict[tuple[int, ...], DeviceMesh] = {}


def mesh(shape: tuple[int, ...]) -> DeviceMesh:
    """One mesh per shape per task (made in the same order on every rank)."""
    if shape not in _meshes:
        names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
        _meshes[shape] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _meshes[shape]


_one_rank_groups: list[dist.ProcessGroup] = []


def one_rank_group() -> dist.ProcessGroup:
    """This rank's own one-rank group (made once per task, on every rank)."""
    if not _one_rank_groups:
        _one_rank_groups.append(dist.new_subgroups(group_size=1)[0])
    return _one_rank_groups[0]


def forget_meshes() -> None:
    _meshes.clear()
    _one_rank_groups.clear()


def make(s: Scenario, a: SimpleNamespace) -> nn.Module:
    """The scenario's model, wrapped or sharded by framework ``a``."""
    net = build(s.model)
    with warnings.catch_warnings():
        if s.probe != "world_one":  # that probe's subject is a warning at construction
            warnings.simplefilter("ignore")
        return wrap_wrapper(s, a, net) if s.front == "wrapper" else shard_composable(s, a, net)


def wrap_wrapper(s: Scenario, a: SimpleNamespace, net: nn.Module) -> nn.Module:
    kwargs: dict = {}
    if "HYBRID" in s.strategy:
        kwargs["device_mesh"] = mesh((s.world // 2, 2))
    elif s.probe == "world_one":  # each rank alone in its process group
        kwargs["process_group"] = one_rank_group()
    if s.offload:
        kwargs["cpu_offload"] = a.CPUOffload(offload_params=True)
    if s.mixed:
        kwargs["mixed_precision"] = a.MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16
        )
    return a.FSDP(
        net,
        auto_wrap_policy=a.ModuleWrapPolicy({Block}),
        device_id=CPU,
        use_orig_params=s.use_orig_params,
        sharding_strategy=getattr(a.ShardingStrategy, s.strategy),
        **kwargs,
    )


def shard_composable(s: Scenario, a: SimpleNamespace, net: nn.Module) -> nn.Module:
    kwargs: dict = {"mesh": mesh((s.world // 2, 2)) if s.strategy == "hsdp" else mesh((s.world,))}
    kwargs["reshard_after_forward"] = s.strategy != "keep"
    if s.offload:
        kwargs["offload_policy"] = a.CPUOffloadPolicy(pin_memory=False)
    if s.mixed:
        kwargs["mp_policy"] = a.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    if s.probe == "shared_across_units":  # a weight used by two units: torch's error
        net.block2.lin1.weight = net.block1.lin1.weight
    for block in (net.block1, net.block2):
        a.fully_shard(block, **kwargs)
    a.fully_shard(net, **kwargs)
    return net
