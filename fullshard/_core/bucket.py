"""Several small units' all-gathers as one collective.

[Note: Gather buckets]
Each collective costs a latency (gloo: a round trip; NCCL: a kernel launch and
a ring step; torch's fake group: O(world) Python per call) whatever its bytes,
so a model of many small units (deep narrow stacks, experts, LoRA) pays for
calls, not bytes. When the schedule prefetches (see [Note: Prefetch]) and the
unit to prefetch is small, it gathers that unit and the next ones of the same
order together: one ``(W, sum of chunks)`` output, each unit's copy-in
written straight into its columns of this rank's row, one all-gather, then
each unit's own copy-out from its columns when it is used. So every unit ends
up exactly as if it had gathered alone (its own unsharded storage, freed by
its own reshard); only the output is shared, alive until the bucket's last
unit has copied out. A unit under FSDP1's flat layout needs its W chunks
back to back: its copy-out first copies its columns into one contiguous
temporary (the unit's gathered size, small by the bucket's limit). Torch's FSDP has no such bucket (DeepSpeed's ZeRO-3
has one, by parameter count).

A bucket holds consecutive units of the prefetch order that agree: the same
shard group, gather dtype (not a mixed-dtype byte layout), layout kind (per
parameter or FSDP1's flat) and device, with no CPU offload, quantized codes,
tensor-subclass extension, custom all-gather or kept post-forward shard. It
stops at the first unit that needs a gather and cannot join, at a unit
already in it, or where its gathered bytes would pass the limit (the head
unit's ``all_gather_bucket_bytes``: bytes of the gathered, padded parameters
in the gather dtype; 0 turns buckets off). Units that need no gather (already
unsharded or in flight) are stepped over. A bucket of one unit is a plain
gather. Every rank forms the same buckets from the same order and settings,
so the collectives stay matched; at DETAIL debug level nothing is prefetched
(see [Note: Execution order]), so every gather is checked alone. The first
step has no recorded forward order: its forward gathers unit by unit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from . import comm, offload, trace
from .all_gather import AllGather, AllGatherInFlight
from .mesh import GroupInfo

# Units of at most this many gathered bytes are bucketed by default (see the Note); the bench GPT's
# 3.4 MiB blocks are not, 128 units of Linear(64, 64) are (benchmarks/RESULTS.md, issue 24).
DEFAULT_ALL_GATHER_BUCKET_BYTES = 1024 * 1024


class BucketKey(NamedTuple):
    """What units must share to gather in one collective (see [Note: Gather buckets])."""

    group: dist.ProcessGroup
    dtype: torch.dtype
    flat: bool
    device: torch.device


def bucket_key(gather: AllGather, group: GroupInfo, offloaded: bool) -> BucketKey | None:
    """The key under which ``gather`` (over ``group``) may join a bucket, or None when it gathers alone."""
    layout = gather.buffers.gather_layout
    if group.size == 1 or offloaded or gather.buffers.extended or gather.codec is not None:
        return None
    if gather.custom is not None or layout.dtype == torch.uint8:
        return None
    return BucketKey(group.process_group, layout.dtype, layout.flat, gather.device)


def gathered_bytes(gather: AllGather, group: GroupInfo) -> int:
    """Bytes of ``gather``'s output over ``group``: what a bucket's limit counts."""
    layout = gather.buffers.gather_layout
    return group.size * layout.total * layout.dtype.itemsize


class _SharedWork:
    """One collective behind several units' waits: waited for once."""

    def __init__(self, work: comm.Waitable | None) -> None:
        self._work = work

    def wait(self) -> bool:
        work, self._work = self._work, None
        if work is not None:
            work.wait()
        return True


def gather_bucket(gathers: list[AllGather], group: GroupInfo, labels: trace.UnitLabels) -> list[AllGatherInFlight]:
    """Issues one all-gather for ``gathers`` (keys equal, see ``bucket_key``) over ``group``,
    asynchronously; returns each unit's in-flight gather, its output the unit's columns."""
    device = gathers[0].device
    layouts = [g.buffers.gather_layout for g in gathers]
    starts = [0]
    for layout in layouts:
        starts.append(starts[-1] + layout.total)
    output = torch.empty(group.size, starts[-1], dtype=layouts[0].dtype, device=device)
    row = output[group.rank]
    work = offload.run_on_stream(device, offload.ALL_GATHER, _issue, gathers, starts, output, row, group, labels)
    shared = _SharedWork(work)
    return [
        AllGatherInFlight(shared, row[start:stop], output[:, start:stop], layout, group.size)
        for start, stop, layout in zip(starts, starts[1:], layouts)
    ]


def _issue(
    gathers: list[AllGather],
    starts: list[int],
    output: torch.Tensor,
    row: torch.Tensor,
    group: GroupInfo,
    labels: trace.UnitLabels,
) -> comm.Waitable | None:
    """``gather_bucket``'s work on the copy stream: every copy-in, then the collective."""
    with trace.span(labels.all_gather_copy_in):
        if any(g.buffers.needs_cast or g.buffers.shard_buffer.device != row.device for g in gathers):
            for gather, start, stop in zip(gathers, starts, starts[1:]):
                gather.copy_in(row[start:stop])
        else:  # one op for the whole bucket
            torch.cat([g.buffers.shard_buffer for g in gathers], out=row)
    return trace.call(labels.all_gather, comm.all_gather, output.view(-1), row, group.process_group, True)
