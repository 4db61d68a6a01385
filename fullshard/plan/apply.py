"""A ``Choice`` applied to a model (``apply_choice``), and as the lines of code a user keeps (``choice_code``)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .. import (
    AllGatherQuantization,
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    hybrid_mesh,
    replicate,
    set_all_gather_quantization,
)
from .choice import Choice
from .model_step import checkpoint_blocks

__all__ = ["apply_choice", "choice_code"]

_DTYPE_NAMES = {torch.bfloat16: "torch.bfloat16", torch.float16: "torch.float16", torch.int8: "torch.int8"}


def _mesh(choice: Choice, device_type: str) -> DeviceMesh:
    if choice.strategy == "hybrid":
        return hybrid_mesh(device_type, choice.shard_size)
    with torch.device("cpu"):
        return init_device_mesh(device_type, (choice.world_size,))


def apply_choice(model: nn.Module, blocks: list[nn.Module], choice: Choice, device_type: str = "cuda") -> nn.Module:
    """Shards ``model`` in place as ``choice`` says: each of ``blocks`` a unit, then the root.

    Args:
        model: the model, its parameters on the device (or meta, to be initialised after).
        blocks: the units but the root (``fullshard.plan.select_blocks``).
        choice: what ``plan`` chose.
        device_type: the mesh's device type.
    """
    if choice.checkpointing:
        checkpoint_blocks(blocks)
    mesh = _mesh(choice, device_type)
    mp = (
        MixedPrecisionPolicy(param_dtype=choice.mixed_precision, reduce_dtype=choice.dtype)
        if choice.mixed_precision is not None
        else MixedPrecisionPolicy()
    )
    offload = CPUOffloadPolicy(pin_memory=device_type == "cuda") if choice.cpu_offload else OffloadPolicy()
    if choice.strategy == "no-shard":
        for module in [*blocks, model]:
            replicate(module, mesh=mesh, mp_policy=mp, offload_policy=offload)
        return model
    block_reshard: bool | int = choice.strategy != "grad-op"
    if choice.reshard_to is not None:
        block_reshard = choice.reshard_to
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=block_reshard, mp_policy=mp, offload_policy=offload)
    fully_shard(
        model,
        mesh=mesh,
        reshard_after_forward=None if choice.strategy != "grad-op" else False,
        mp_policy=mp,
        offload_policy=offload,
    )
    if choice.all_gather_dtype is not None and choice.shard_size > 1:
        set_all_gather_quantization(model, AllGatherQuantization(dtype=choice.all_gather_dtype))
    return model


def _blocks_expression(names: list[str]) -> str:
    """``model.layers`` when the blocks are one container's items, else a list of them."""
    containers = {name.rpartition(".")[0] for name in names}
    indices = [name.rpartition(".")[2] for name in names]
    if len(containers) == 1 and all(i.isdigit() for i in indices) and "" not in containers:
        return f"model.{containers.pop()}"
    return "[" + ", ".join(f"model.get_submodule({name!r})" for name in names) + "]"


def choice_code(choice: Choice, block_names: list[str], device_type: str = "cuda") -> str:
    """The lines of code that apply ``choice`` (what ``apply_choice`` does), for the user to keep."""
    imports = ["fully_shard" if choice.strategy != "no-shard" else "replicate"]
    lines = []
    if choice.strategy == "hybrid":
        imports.append("hybrid_mesh")
        lines.append(f'mesh = hybrid_mesh("{device_type}", {choice.shard_size})  # shard within {choice.shard_size}')
    else:
        lines.append(f'mesh = init_device_mesh("{device_type}", ({choice.world_size},))')
    settings = ["mesh=mesh"]
    if choice.mixed_precision is not None:
        imports.append("MixedPrecisionPolicy")
        name = _DTYPE_NAMES[choice.mixed_precision]
        settings.append(f"mp_policy=MixedPrecisionPolicy(param_dtype={name}, reduce_dtype=torch.float32)")
    if choice.cpu_offload:
        imports.append("CPUOffloadPolicy")
        settings.append("offload_policy=CPUOffloadPolicy()")
    common = ", ".join(settings)
    blocks = _blocks_expression(block_names) if block_names else "[]"
    call = "fully_shard" if choice.strategy != "no-shard" else "replicate"
    block_settings = common
    if choice.strategy == "grad-op":
        block_settings += ", reshard_after_forward=False"
    if choice.reshard_to is not None:
        block_settings += f", reshard_after_forward={choice.reshard_to}"
    if choice.checkpointing:
        lines.append("from torch.utils.checkpoint import checkpoint")
    lines.append(f"for block in {blocks}:")
    if choice.checkpointing:
        lines.append("    block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)")
    lines.append(f"    {call}(block, {block_settings})")
    root_settings = common + (", reshard_after_forward=False" if choice.strategy == "grad-op" else "")
    lines.append(f"{call}(model, {root_settings})")
    if choice.all_gather_dtype is not None and choice.shard_size > 1:
        imports += ["AllGatherQuantization", "set_all_gather_quantization"]
        lines.append(
            f"set_all_gather_quantization(model, AllGatherQuantization(dtype={_DTYPE_NAMES[choice.all_gather_dtype]}))"
        )
    if choice.accumulation > 1:
        lines.append(
            f"# {choice.accumulation} micro-batches of {choice.micro_batch} per optimizer step "
            "(backward each, then step)"
        )
    header = ["import torch"]
    if choice.checkpointing:
        header.append("import functools")
    if choice.strategy != "hybrid":
        header.append("from torch.distributed.device_mesh import init_device_mesh")
    header.append(f"from fullshard import {', '.join(sorted(set(imports)))}")
    return "\n".join(header + lines)
