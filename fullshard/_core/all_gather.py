"""A unit's all-gather in three steps: copy-in (this rank's shards onto the
compute device, in the gather dtype), the collective, and copy-out (into each
parameter's unsharded storage). See [Note: Unit buffers] in layout.py and
[Note: CPU offload] in offload.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from . import comm, offload, trace
from .buffers import UnitBuffers
from .layout import Layout
from .mesh import GroupInfo
from .param import ShardParam


class _Waitable(Protocol):
    def wait(self) -> Any: ...


@dataclass
class AllGatherInFlight:
    work: _Waitable | None  # None: nothing to wait for (a group of one)
    input: torch.Tensor  # kept alive until the collective is done
    output: torch.Tensor
    layout: Layout
    num_chunks: int


@dataclass
class PostForwardShard:
    """1/k of the full parameters kept after forward, for a re-gather within the k-group."""

    source: torch.Tensor  # 1D
    layout: Layout
    group: GroupInfo


def process_group(info: GroupInfo) -> dist.ProcessGroup:
    """The process group of a collective over ``info`` (one of size > 1 always has one)."""
    if info.group is None:
        raise AssertionError(f"a group of size {info.size} has no process group (rank {info.rank})")
    return info.group


def split_views(params: list[ShardParam], padded: list[torch.Tensor]) -> list[list[torch.Tensor] | None] | None:
    """Per-rank views for parameters sharded on a dim other than 0 (see layout.py)."""
    if all(p.shard_dim == 0 for p in params):
        return None
    return [p.split_views(t) for p, t in zip(params, padded)]


class AllGather:
    """The all-gather steps of one unit's parameters."""

    def __init__(self, params: list[ShardParam], buffers: UnitBuffers, device: torch.device, offload: bool) -> None:
        self.params = params
        self.buffers = buffers
        self.device = device  # where compute and communication happen
        self.offload = offload

    def _copy_stream(self) -> contextlib.AbstractContextManager:
        """Where the shards are cast or copied to the device and their all-gather is
        issued (see [Note: Streams] in offload.py)."""
        return offload.on_stream(self.device, offload.ALL_GATHER)

    def input(self, labels: trace.UnitLabels) -> torch.Tensor:
        """This rank's shards on the compute device, in the gather dtype (copy-in)."""
        buffers = self.buffers
        shard_buffer, gather_layout = buffers.shard_buffer, buffers.gather_layout
        if not buffers.needs_cast and shard_buffer.device == self.device:
            return shard_buffer
        staged = torch.empty(gather_layout.total, dtype=gather_layout.dtype, device=self.device)
        with self._copy_stream(), trace.span(labels.all_gather_copy_in):
            if not buffers.needs_cast or gather_layout.lines_up(buffers.storage_layout):  # one fused cast
                staged.copy_(shard_buffer, non_blocking=True)
            else:
                torch._foreach_copy_(
                    [gather_layout.region(staged, i, p.param_dtype) for i, p in enumerate(self.params)],
                    [buffers.storage_layout.region(shard_buffer, i, p.orig_dtype) for i, p in enumerate(self.params)],
                    non_blocking=True,
                )
        return staged

    def start(
        self, source: torch.Tensor, layout: Layout, group: GroupInfo, async_op: bool, labels: trace.UnitLabels
    ) -> AllGatherInFlight:
        """Issues the collective over ``group`` (none for a group of one)."""
        if group.size == 1:
            return AllGatherInFlight(None, source, source, layout, 1)
        output = torch.empty(source.numel() * group.size, dtype=source.dtype, device=self.device)
        with self._copy_stream(), trace.span(labels.all_gather):  # after the copy-in
            work = comm.all_gather(output, source, process_group(group), async_op=async_op)
        return AllGatherInFlight(work, source, output, layout, group.size)

    def join(self, source: torch.Tensor, group: GroupInfo) -> None:
        """Takes part in another rank's all-gather of this unit, into scratch
        (execution-order validation, see [Note: Execution order])."""
        if group.size > 1:
            scratch = torch.empty(source.numel() * group.size, dtype=source.dtype, device=self.device)
            with self._copy_stream():
                comm.all_gather(scratch, source, process_group(group), async_op=False)
            offload.join_stream(self.device, offload.ALL_GATHER)

    def copy_out(self, in_flight: AllGatherInFlight, padded: list[torch.Tensor], labels: trace.UnitLabels) -> None:
        """Waits for ``in_flight`` and fills ``padded``, the unsharded parameters' storage."""
        if in_flight.work is not None:
            in_flight.work.wait()
        offload.join_stream(self.device, offload.ALL_GATHER)
        # Saved activations of an earlier forward alias this storage: the refill
        # must not look like an in-place change to autograd (the versions are put back).
        versions = tuple(tensor._version for tensor in padded)
        with torch.no_grad(), trace.span(labels.copy_out):
            in_flight.layout.copy_out(in_flight.output, in_flight.num_chunks, padded, split_views(self.params, padded))
        torch._C._autograd._unsafe_set_version_counter(tuple(padded), versions)

    def keep_post_forward(self, shard_size: int, group: GroupInfo) -> PostForwardShard:
        """This rank's 1/k of the gathered parameters, for a re-gather within ``group``."""
        layout = self.buffers.gather_layout.scaled(shard_size // group.size)
        kept = torch.empty(layout.total, dtype=layout.dtype, device=self.device)
        for index, param in enumerate(self.params):
            full = param.padded_unsharded(self.device)
            full = full if full.dtype == layout.dtype else full.view(layout.dtype)
            layout.region(kept, index, layout.dtype).copy_(full.view(group.size, -1)[group.rank])
        return PostForwardShard(kept, layout, group)
