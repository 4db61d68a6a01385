"""The forms of a unit's parameters and the moves between them: sharded (only
this rank's shards exist), sharded post-forward (a larger shard kept for a
re-gather within a smaller group) and unsharded (the full parameters registered
on the modules). ``unshard`` all-gathers, ``reshard`` frees.

[Note: Kept forms go stale]
A unit can keep its unsharded (or post-forward) form past the step that
gathered it: a no-grad forward has no backward to reshard it, and
``reshard_after_forward=False`` or a kept 1/k shard exist for reuse. If the
shards then change in place (an optimizer step after an evaluation forward, a
state-dict load), reusing the kept form would compute with the old values.
The shards' version counters are recorded when a form is gathered: the
buffer's (shared by its views: plain shards, the flat parameter) and each
sharded parameter's (a DTensor counts its in-place ops on itself, not on its
local tensor); ``unshard`` drops a form whose shards moved on and gathers again. Torch's FSDP
reuses such forms as they are.

``ParamForms`` knows nothing of the step: when a unit changes form is decided
by its lifecycle (``group.ParamGroup``, which extends it) and the root's
schedule. The shard buffer is in buffers.py (see [Note: Unit buffers]), the
all-gather's steps in all_gather.py.
"""

from __future__ import annotations

import enum

import torch

from . import trace
from .all_gather import AllGather, AllGatherInFlight, GatherInput, PostForwardShard
from .buffers import UnitBuffers
from .common import outside_transforms
from .mesh import GroupInfo
from .spec import UnitSpec


class ShardedState(enum.Enum):
    SHARDED = enum.auto()  # only this rank's shards exist
    SHARDED_POST_FORWARD = enum.auto()  # a larger shard for the smaller post-forward group
    UNSHARDED = enum.auto()  # full parameters registered on the modules


class ParamForms:
    """One unit's parameters in their forms (see the module docstring); what the
    unit is (parameters, mesh, devices, name) is its ``spec`` (see [Note: Unit spec])."""

    def __init__(self, spec: UnitSpec) -> None:
        self.spec = spec
        self.buffers = UnitBuffers(spec, [p.bound_rows for p in spec.params])
        self.gather = AllGather(spec, self.buffers)
        self.sharded_state = ShardedState.SHARDED
        self._all_gather: AllGatherInFlight | None = None
        self._shows_shards_unsharded = False  # see show_shards
        self._post_forward_shard: PostForwardShard | None = None
        self._gathered_version: int | None = None  # the shards' version behind a kept form, see the Note

    @property
    def is_unsharded(self) -> bool:
        return self.sharded_state is ShardedState.UNSHARDED

    @outside_transforms
    def unshard(self, async_op: bool = False) -> None:
        """Gathers the full parameters and registers them (no-op if unsharded);
        ``async_op`` only starts the all-gather: ``wait_for_unshard`` finishes it."""
        if self._gathered_version is not None and self._kept_form_stale():  # no call for a form not kept
            self.reshard()
        if self.sharded_state is not ShardedState.UNSHARDED and self._all_gather is None and self.spec.params:
            self._start_all_gather(async_op)
        if not async_op:
            self._finish_unshard()

    def _start_all_gather(self, async_op: bool) -> None:
        spec, buffers = self.spec, self.buffers
        buffers.check_materialized()
        if self._post_forward_shard is None and spec.mesh_info.shard.size == 1:
            if not buffers.needs_cast and not buffers.extended and not spec.offload:
                self._alias_unsharded()
                return
        self._all_gather = self.gather.start(self._gather_input(), async_op, spec.labels)

    def _kept_form_stale(self) -> bool:
        """Whether the shards changed in place since the kept form was gathered (see
        [Note: Kept forms go stale]); traced graphs keep their own forms."""
        version = self._gathered_version
        return version is not None and version != self._shards_version() and not torch.compiler.is_compiling()

    def _shards_version(self) -> int | None:
        """Grows with every in-place change of the shards (versions never decrease);
        None for shards made under ``torch.inference_mode`` (they keep no versions)."""
        buffer = self.buffers.shard_buffer
        if buffer.is_inference():
            return None
        version = buffer._version
        for param in self.spec.params:  # a loop: no generator to build, twice per unit and step
            version += param.sharded_param._version
        return version

    def _gather_input(self) -> GatherInput:
        """What this unit's all-gather sends (copied in), its layout and its group."""
        kept = self._post_forward_shard
        if kept is not None:
            return GatherInput(kept.source, kept.layout, kept.group)
        return self.gather.input(self.spec.labels, self.spec.mesh_info.shard)

    def unshard_needs_collective(self) -> bool:
        """Whether ``unshard()`` would issue an all-gather now."""
        if self._kept_form_stale():
            return self.spec.mesh_info.shard.size > 1
        if self.is_unsharded or self._all_gather is not None or not self.spec.params:
            return False
        if self._post_forward_shard is not None:
            return self._post_forward_shard.group.size > 1
        return self.spec.mesh_info.shard.size > 1

    def join_all_gather(self) -> None:
        """Takes part in another rank's all-gather of this unit, into scratch
        (execution-order validation, see [Note: Execution order])."""
        self.gather.join(self._gather_input(), self.spec.labels)

    def _alias_unsharded(self) -> None:
        buffers = self.buffers
        if buffers.view is not None:
            buffers.view.sync_requires_grad()
        for index, param in enumerate(self.spec.params):
            param.alias_unsharded(buffers.storage_layout.region(buffers.shard_buffer, index, param.orig_dtype))
            param.to_unsharded()
        self.sharded_state = ShardedState.UNSHARDED

    @outside_transforms
    def wait_for_unshard(self) -> None:
        """Finishes an in-flight unshard: copy-out and registration of full parameters."""
        self._finish_unshard()

    def _finish_unshard(self) -> None:  # wait_for_unshard, for callers outside transforms already
        in_flight, self._all_gather = self._all_gather, None
        if in_flight is None:
            if self._shows_shards_unsharded:  # kept unsharded but showing the shards
                self._register_unsharded()
            return
        self.gather.copy_out(in_flight, self.spec.labels)
        if self._post_forward_shard is None:  # else still the version the kept shard came from
            self._gathered_version = self._shards_version()
        self._post_forward_shard = None
        self._register_unsharded()
        self.sharded_state = ShardedState.UNSHARDED

    def _register_unsharded(self) -> None:
        if self.buffers.view is not None:
            self.buffers.view.sync_requires_grad()
        for param in self.spec.params:
            param.to_unsharded()
        self._shows_shards_unsharded = False

    def show_shards(self) -> None:
        """Registers the shards but keeps the full parameters for the next use
        (a no-grad forward under a presentation that asks for it)."""
        for param in self.spec.params:
            param.to_sharded()
        self._shows_shards_unsharded = True

    @outside_transforms
    def reshard(self) -> None:
        """Frees the full parameters and registers the shards."""
        if self._all_gather is not None:
            self._finish_unshard()
        if self.sharded_state is ShardedState.SHARDED:
            return
        if self.spec.presentation.refuses_unsharded_data_assignment and self.is_unsharded:
            self._refuse_unsharded_data_assignment()
        trace.call(self.spec.labels.reshard, self._free_and_register_shards)
        self._shows_shards_unsharded = False
        self._post_forward_shard = None
        self._gathered_version = None
        self.sharded_state = ShardedState.SHARDED

    def _free_and_register_shards(self) -> None:
        for param in self.spec.params:
            if not param.aliases_shard:
                param.free_unsharded()
            param.to_sharded()

    def _refuse_unsharded_data_assignment(self) -> None:
        assigned = [p.fqn for p in self.spec.params if p.unsharded_data_assigned()]
        if assigned:
            presentation = self.spec.presentation
            raise presentation.refusal(
                f"{self.spec.name}{presentation.refusal_setting}: the .data of gathered parameters {assigned} was "
                "assigned a new tensor while they were unsharded (between forward and backward, or after "
                "unshard()); its values cannot reach the shards. Assign .data outside forward and backward, or "
                "copy values in place inside summon_full_params(writeback=True)"
            )

    def reshard_to_post_forward(self, group: GroupInfo) -> None:
        """Keeps 1/k of the full parameters for a re-gather within the k-group."""
        kept, version = self.gather.keep_post_forward(self.spec.mesh_info.shard.size, group), self._gathered_version
        self.reshard()
        self._post_forward_shard, self._gathered_version = kept, version
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    def drop_post_forward_shard(self) -> None:
        """Forgets the larger shard kept since forward (the shards are registered)."""
        if self._post_forward_shard is not None:
            self._post_forward_shard = None
            self._gathered_version = None
            self.sharded_state = ShardedState.SHARDED

    def set_full_precision(self, full_precision: bool) -> None:
        """Gathers and computes in the parameters' own dtype (True) instead of the
        mixed-precision ``param_dtype``; the unsharded forms change dtype, so a
        change reshards first."""
        params = self.spec.params
        if all(p.full_precision == full_precision for p in params):
            return
        self.reshard()
        for param in params:
            param.full_precision = full_precision
        self.buffers.set_dtypes()

    def repack_after_apply(self) -> None:
        """``nn.Module._apply`` (``to_empty``, ``to``, ``half``) gave the shards new
        tensors: re-packs them into the shard buffer so the all-gather stays
        copy-free. ``_apply`` visits a unit over several modules (``[norm, head]``)
        one module at a time: re-packs once all its shards share a device again,
        since packing a moved half with a meta half would leave it all on meta."""
        if len({getattr(p.module_registration(), "device", None) for p in self.spec.params}) == 1:
            self.buffers.rebind(self.spec.name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec.name}, {len(self.spec.params)} params)"
