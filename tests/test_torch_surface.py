"""torch's FSDP2 public surface exists in fullshard with torch's signatures.

Every public name of the installed torch's ``torch.distributed.fsdp`` (and
``.wrap``) and every public ``FSDPModule`` method is compared with ours by
``inspect.signature``: the same parameters in the same order, of the same
kinds, with the same defaults. Annotations are not compared (torch's are
evaluated, ours are strings under ``from __future__ import annotations``), nor
are underscore parameters (private to each side). fullshard's own extensions
are listed below and must come after torch's, keyword-only with a default.
Names this torch lacks are not compared, but torch 2.14's whole surface must
exist whatever torch is installed (``TORCH_2_14_*``). ``make check-torch`` runs
this file on the oldest and newest supported torch.
"""

import enum
import inspect

import pytest
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp.wrap as torch_wrap

import fullshard
import fullshard.wrap

# fullshard's parameters beyond torch's, by public name.
EXTENSIONS = {"fully_shard": {"policy", "strategy", "ignored_modules"}}
# Parameters newer torch added, which older torch's signatures lack.
NEWER_TORCH_PARAMETERS = {"fully_shard": {"dp_mesh_dims"}}

TORCH_2_14_NAMES = (
    "BackwardPrefetch CPUOffload CPUOffloadPolicy DataParallelMeshDims FSDPModule FullOptimStateDictConfig "
    "FullStateDictConfig FullyShardedDataParallel LocalOptimStateDictConfig LocalStateDictConfig MixedPrecision "
    "MixedPrecisionPolicy OffloadPolicy OptimStateDictConfig OptimStateKeyType ShardedOptimStateDictConfig "
    "ShardedStateDictConfig ShardingStrategy StateDictConfig StateDictSettings StateDictType UnshardHandle "
    "fully_shard register_fsdp_forward_method share_comm_ctx"
).split()
TORCH_2_14_METHODS = (
    "reset_iter_state reshard set_all_reduce_hook set_allocate_memory_from_process_group_for_comm "
    "set_custom_all_gather set_custom_reduce_scatter set_force_sum_reduction_for_comms set_gradient_divide_factor "
    "set_is_last_backward set_modules_to_backward_prefetch set_modules_to_forward_prefetch set_post_optim_event "
    "set_reduce_scatter_divide_factor set_reduce_scatter_max_input_buffers set_reduce_scatter_unused_params "
    "set_requires_all_reduce set_requires_gradient_sync set_reshard_after_backward set_reshard_after_forward "
    "set_separate_reduce_scatter_group set_symm_mem_for_comm set_unshard_in_backward unshard"
).split()


def _public_parameters(obj: object) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(obj).parameters.values() if not p.name.startswith("_")]


def signature_difference(name: str, theirs: object, ours: object) -> str | None:
    """Why ``ours`` cannot be called as ``theirs`` is, or None."""
    their_params, our_params = _public_parameters(theirs), _public_parameters(ours)
    extras = EXTENSIONS.get(name, set()) | NEWER_TORCH_PARAMETERS.get(name, set())
    if len(our_params) < len(their_params):
        return f"{name}: torch has {[p.name for p in their_params]}, we have {[p.name for p in our_params]}"
    for theirs_p, ours_p in zip(their_params, our_params):
        if (theirs_p.name, theirs_p.kind) != (ours_p.name, ours_p.kind):
            return f"{name}: torch's {theirs_p} where we have {ours_p}"
        if theirs_p.default is not inspect.Parameter.empty or ours_p.default is not inspect.Parameter.empty:
            if repr(theirs_p.default) != repr(ours_p.default):  # torch's classes are not ours
                return f"{name}: torch's default {theirs_p} where ours is {ours_p}"
    for extra in our_params[len(their_params) :]:
        if extra.name not in extras:
            return f"{name}: {extra.name} is not torch's (add it to EXTENSIONS if it is on purpose)"
        if extra.kind is not inspect.Parameter.KEYWORD_ONLY or extra.default is inspect.Parameter.empty:
            return f"{name}: extension {extra} must be keyword-only with a default"
    return None


def _callable_of(obj: object) -> object:
    return obj.__init__ if inspect.isclass(obj) else obj  # type: ignore[misc]


def _public(module: object) -> list[str]:
    return [n for n in module.__all__ if not inspect.ismodule(getattr(module, n))]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "theirs, ours", [(torch_fsdp, fullshard), (torch_wrap, fullshard.wrap)], ids=["fsdp", "fsdp.wrap"]
)
def test_every_public_name_has_torchs_signature(theirs, ours):
    differences = []
    for name in _public(theirs):
        if not hasattr(ours, name):
            differences.append(f"{name}: missing")
            continue
        if name == "FSDPModule":  # a mixin: its methods are compared below
            continue
        their_obj, our_obj = getattr(theirs, name), getattr(ours, name)
        if inspect.isclass(their_obj) and issubclass(their_obj, enum.Enum):
            missing = set(their_obj.__members__) - set(our_obj.__members__)
            if missing:
                differences.append(f"{name}: members {sorted(missing)} missing")
            continue
        difference = signature_difference(name, _callable_of(their_obj), _callable_of(our_obj))
        if difference:
            differences.append(difference)
    assert not differences, "\n".join(differences)


def test_every_fsdp_module_method_has_torchs_signature():
    differences = []
    for name, their_method in inspect.getmembers(torch_fsdp.FSDPModule, inspect.isfunction):
        if name.startswith("_") or their_method.__qualname__.startswith("Module."):
            continue
        our_method = getattr(fullshard.FSDPModule, name, None)
        if our_method is None:
            differences.append(f"FSDPModule.{name}: missing")
        elif difference := signature_difference(f"FSDPModule.{name}", their_method, our_method):
            differences.append(difference)
    assert not differences, "\n".join(differences)


def test_torch_2_14_surface_exists_on_every_torch():
    assert [n for n in TORCH_2_14_NAMES if not hasattr(fullshard, n)] == []
    assert [m for m in TORCH_2_14_METHODS if not callable(getattr(fullshard.FSDPModule, m, None))] == []
    assert "dp_mesh_dims" in inspect.signature(fullshard.fully_shard).parameters


def test_the_comparison_catches_differences():
    def torchs(module, *, mesh=None, reshard_after_forward=None): ...

    def renamed(module, *, device_mesh=None, reshard_after_forward=None): ...

    def other_default(module, *, mesh=None, reshard_after_forward=True): ...

    def positional(module, mesh=None, reshard_after_forward=None): ...

    def extra(module, *, mesh=None, reshard_after_forward=None, policy=None): ...

    assert signature_difference("f", torchs, torchs) is None
    assert "device_mesh" in signature_difference("f", torchs, renamed)
    assert "default" in signature_difference("f", torchs, other_default)
    assert signature_difference("f", torchs, positional) is not None
    assert "not torch's" in signature_difference("f", torchs, extra)
    assert signature_difference("fully_shard", torchs, extra) is None
