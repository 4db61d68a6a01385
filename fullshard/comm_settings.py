"""torch 2.14's communication settings of ``FSDPModule``.

Each has torch's signature. What fullshard's engine can honour it does
(``set_post_optim_event``, ``set_separate_reduce_scatter_group``, the custom
all-gather and reduce-scatter); the knobs that tune something this engine does
not do warn once that they have no effect.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from ._core.comm import CustomGatherWire, CustomScatterWire, GroupInfo

if TYPE_CHECKING:
    from ._core.step import ModuleState
    from ._core.unit import ParamGroup

__all__ = ["CommSettings"]

_warned: set[str] = set()


def _warn_no_effect(setting: str, why: str) -> None:
    if setting not in _warned:
        _warned.add(setting)
        warnings.warn(f"{setting} has no effect with fullshard: {why}", UserWarning, stacklevel=3)


class CommSettings:
    """Mixed into ``FSDPModule`` (which supplies ``_fsdp_state`` and ``_groups``)."""

    if TYPE_CHECKING:

        def _fsdp_state(self) -> ModuleState: ...

        def _groups(self, recurse: bool) -> Iterable[ParamGroup]: ...

    def set_post_optim_event(self, event: torch.Event) -> None:
        """Makes the root's next all-gather wait for ``event`` (recorded after the
        optimizer step), then forgets it: pass a new event every step. The
        all-gather stream also still waits for the current stream, since
        fullshard allocates its communication buffers there. Nothing to wait
        for on a CPU mesh."""
        self._fsdp_state().ctx.post_optim_event = event

    def set_custom_all_gather(self, comm: Any) -> None:
        """This unit's all-gathers allocate their output with ``comm.allocate(size, dtype=,
        device=)`` and run as ``comm(output_tensor=, input_tensor=, group=, async_op=)``
        (torch's ``AllGather``), in place of fullshard's own; the comm spy still counts them."""
        for group in self._groups(recurse=False):
            group.settings.gather_wire = group.settings.gather_wire.carried_by(CustomGatherWire(comm))

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """This unit's gradient reduce-scatters allocate their input and output with
        ``comm.allocate`` and run as ``comm(output_tensor=, input_tensor=, group=, op=)``
        (torch's ``ReduceScatter``, called without ``async_op`` as torch calls it), in place of
        fullshard's own; averaging, HSDP's all-reduce and the hooks stay as they are."""
        for group in self._groups(recurse=False):
            group.settings.reduce.reduce_scatter = CustomScatterWire(comm)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """Validated as torch does; no effect: fullshard allocates each reduce-scatter
        input anew and never waits to reuse one, so there is no stall to remove."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"set_reduce_scatter_max_input_buffers expects an int but got {type(max_input_buffers).__name__} "
                f"for {type(self).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(
                f"set_reduce_scatter_max_input_buffers expects an int >= 1 but got {max_input_buffers} "
                f"for {type(self).__name__}"
            )
        if max_input_buffers > 1:
            _warn_no_effect(
                "set_reduce_scatter_max_input_buffers",
                "each reduce-scatter input is a new buffer, none waits to be reused",
            )

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Runs gradient reduce-scatters on a process group of their own over the
        shard ranks (one per rank set), so they do not queue behind all-gathers
        on one communicator. Creating the group is collective: call it on every
        rank alike. ``False`` goes back to the mesh's group."""
        created: dict[tuple[int, ...], GroupInfo] = {}
        for group in self._groups(recurse):
            shard = group.spec.mesh_info.shard
            if not enable or shard.group is None:
                group.settings.reduce.scatter_group = None
                continue
            ranks = tuple(dist.get_process_group_ranks(shard.group))
            if ranks not in created:
                new = dist.new_group(list(ranks), use_local_synchronization=True)
                created[ranks] = GroupInfo(new, shard.size, shard.rank)
            group.settings.reduce.scatter_group = created[ranks]

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """No effect: communication buffers come from torch's caching allocator.

        Raises:
            AssertionError: this unit has a custom all-gather or reduce-scatter, which
                allocates its own buffers (torch raises the same type).
        """
        for group in self._groups(recurse=False):
            custom = group.settings.gather_wire.user or group.settings.reduce.reduce_scatter.user
            if custom is not None:
                raise AssertionError(
                    "cannot call set_allocate_memory_from_process_group_for_comm() on a unit with a custom "
                    f"all-gather or reduce-scatter ({type(custom).__name__} on {group.spec.name}): it allocates "
                    "its own buffers"
                )
        if enable:
            _warn_no_effect(
                "set_allocate_memory_from_process_group_for_comm",
                "its communication buffers come from torch's caching allocator",
            )

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """torch's private setter (its tests and some recipes call it): ``True`` makes FSDP2's
        pre-forward and pre-backward all-gathers allocate in the current stream. No effect:
        fullshard's already do."""
        if async_op:
            _warn_no_effect("_set_unshard_async_op", "its all-gathers already allocate in the current stream")

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """No effect: fullshard's all-gathers do not use symmetric memory (and a CPU
        mesh has none)."""
        if backend != "NCCL":
            raise ValueError(
                f"set_symm_mem_for_comm expects backend 'NCCL' but got {backend!r} for {type(self).__name__}"
            )
        _warn_no_effect("set_symm_mem_for_comm", "its all-gather buffers are not allocated in symmetric memory")
