"""Full parameters on demand, outside forward and backward (``summon_full_params``).

Gathers in the parameters' own dtype (not the mixed-precision compute dtype)
into fresh tensors, so nothing the training step relies on is touched; on exit
changes are written back to the shards and the shards are registered again.
A wrapper's flat parameter is hidden meanwhile: ``named_parameters()`` then
lists exactly the original model's parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from .common import TrainingState
from .group import ParamGroup
from .state import ModuleState


@contextlib.contextmanager
def full_params(
    states: list[ModuleState],
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Registers every managed parameter of ``states`` unsharded for the block.

    Raises:
        NotImplementedError: ``writeback`` with ``rank0_only`` (other ranks
            would have nothing to write back); the type PyTorch's FSDP1 raises.
        AssertionError: called during forward or backward (as PyTorch's FSDP1).
    """
    if writeback and rank0_only:
        raise NotImplementedError(
            "summon_full_params with rank0_only=True is not yet supported with writeback=True: only rank 0 "
            "holds the full parameters, so the other ranks could not write changes back; pass writeback=False"
        )
    groups = [state.group for state in states if state.group is not None]
    for group in groups:
        if group.training_state is not TrainingState.IDLE:
            raise AssertionError(
                f"summon_full_params expects no forward or backward in progress, but unit "
                f"{group.owner_name} is in {group.training_state.name}"
            )
    keep = not rank0_only or dist.get_rank() == 0
    summoned: list[ParamGroup] = []
    try:
        for group in groups:
            group.reshard()  # drop a low-precision unsharded copy kept after forward
            values = group.gather_full()
            grads = group.gather_full(grads=True) if with_grads else [None] * len(values)
            if not keep:
                continue
            if offload_to_cpu:
                values = [v.cpu() for v in values]
                grads = [g.cpu() if g is not None else None for g in grads]
            for param, value, grad in zip(group.params, values, grads):
                param.show_full(value, grad, with_grads)
            if group.flat_param_home is not None:  # the full parameters stand in for it
                home, name = group.flat_param_home
                del home._parameters[name]
            summoned.append(group)
        yield
    finally:
        for group in summoned:
            if writeback:
                group.write_back([param.full_shown() for param in group.params])
            for param in group.params:
                param.end_show_full()
            if group.flat_param_home is not None:
                home, name = group.flat_param_home
                home._parameters[name] = group.flat_param
