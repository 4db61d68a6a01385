"""One scenario's model under one framework: ``torch`` (the oracle) or ``ours``, same names, by import."""

from __future__ import annotations

import functools
import warnings
from types import SimpleNamespace
from typing import Any

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
    policies = ("ModuleWrapPolicy", "CustomPolicy", "size_based_auto_wrap_policy", "lambda_auto_wrap_policy")
    for policy in (*policies, "transformer_auto_wrap_policy"):
        setattr(ns, policy, getattr(wrap, policy))
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


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear)


def auto_wrap_policy(s: Scenario, a: SimpleNamespace, net: nn.Module) -> Any:
    """The probe's auto-wrap policy (``policy_*`` probes), else one unit per ``Block``."""
    if s.probe == "policy_size":  # a Block holds 82 parameters: each its unit, the root the rest
        return functools.partial(a.size_based_auto_wrap_policy, min_num_params=60)
    if s.probe == "policy_lambda":
        return functools.partial(a.lambda_auto_wrap_policy, lambda_fn=_is_linear)
    if s.probe == "policy_transformer":
        return functools.partial(a.transformer_auto_wrap_policy, transformer_layer_cls={Block})
    if s.probe == "policy_classes":
        return a.ModuleWrapPolicy({Block, nn.LayerNorm, nn.Linear})
    if s.probe == "policy_custom":  # per-unit overrides: block1 keeps its parameters after forward
        keeping = "_HYBRID_SHARD_ZERO2" if "HYBRID" in s.strategy else "SHARD_GRAD_OP"
        keep = {"sharding_strategy": getattr(a.ShardingStrategy, keeping)}
        return a.CustomPolicy(lambda m: keep if m is net.block1 else isinstance(m, Block))
    return a.ModuleWrapPolicy({Block})


def wrap_wrapper(s: Scenario, a: SimpleNamespace, net: nn.Module) -> nn.Module:
    kwargs: dict = {}
    if s.probe == "ignored_modules":
        kwargs["ignored_modules"] = [net.mid]
    elif s.probe == "ignored_states":
        # Parameters only: FSDP1 (and fullshard) refuse a list mixing parameters and modules at construction.
        kwargs["ignored_states"] = [net.out.weight, net.block2.lin2.weight, net.block2.lin2.bias]
    elif s.probe == "ignored_module_invalid":  # a unit listed as ignored: torch's ValueError
        net.block1 = a.FSDP(net.block1, device_id=CPU)
        kwargs["ignored_modules"] = [net.block1]
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
    kwargs.update(
        device_id=CPU, use_orig_params=s.use_orig_params, sharding_strategy=getattr(a.ShardingStrategy, s.strategy)
    )
    if s.probe == "osd_partly_wrapped":  # units below a plain root: the root's own parameters are unmanaged
        for name in ("block1", "block2"):
            setattr(net, name, a.FSDP(getattr(net, name), **kwargs))
        return net
    if s.probe == "eval_half_root":  # the model itself in bf16, its compute dtype fp16 (whatever s.mixed says)
        net.to(torch.bfloat16)
        kwargs["mixed_precision"] = a.MixedPrecision(param_dtype=torch.float16, buffer_dtype=torch.float16)
    return a.FSDP(net, auto_wrap_policy=auto_wrap_policy(s, a, net), **kwargs)


def shard_composable(s: Scenario, a: SimpleNamespace, net: nn.Module) -> nn.Module:
    kwargs: dict = {"mesh": mesh((s.world // 2, 2)) if s.strategy == "hsdp" else mesh((s.world,))}
    kwargs["reshard_after_forward"] = s.strategy != "keep"
    if s.offload:
        kwargs["offload_policy"] = a.CPUOffloadPolicy(pin_memory=False)
    if s.mixed:
        kwargs["mp_policy"] = a.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    if s.probe == "shared_across_units":  # a weight used by two units: torch's error
        net.block2.lin1.weight = net.block1.lin1.weight
    if s.probe == "norm_full_precision":  # norm modules their own units, kept in fp32 (torch's recipe)
        norm_policy = a.MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for module in net.modules():
            if isinstance(module, nn.LayerNorm):
                a.fully_shard(module, **{**kwargs, "mp_policy": norm_policy})
    for block in (net.block1, net.block2):
        a.fully_shard(block, **kwargs)
    if s.probe == "ignored_params":  # the root leaves ``mid`` alone: replicated, never reduced
        kwargs["ignored_params"] = {net.mid.weight, net.mid.bias}
    a.fully_shard(net, **kwargs)
    return net
