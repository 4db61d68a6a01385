"""A unit's all-gather in three steps: copy-in (this rank's shards onto the
compute device, in the gather dtype), the collective, and copy-out (into each
parameter's unsharded storage). See [Note: Unit buffers] in layout.py and
[Note: CPU offload] in offload.py. Several small units' all-gathers may run as
one collective (buckets).

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
tensor-subclass extension, wire other than the plain one (see [Note: Wires] in
comm.py) or kept post-forward shard. It
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

import contextlib
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist

from .. import comm, offload, trace
from ..comm import PLAIN_GATHER_WIRE, GatherWire, GroupInfo
from ..layout import Layout
from .buffers import UnitBuffers
from .extension import GatherExtension
from .param import ShardParam
from .spec import UnitSpec


def _extension(param: ShardParam) -> GatherExtension:
    if param.extension is None:
        raise AssertionError(f"{param.fqn} has no gather extension")
    return param.extension


@dataclass
class AllGatherInFlight:
    work: comm.Waitable | None  # None: nothing to wait for (a group of one)
    input: torch.Tensor  # kept alive until the collective is done
    output: torch.Tensor  # (num_chunks, chunk), or flat
    layout: Layout
    num_chunks: int
    # Parameters whose extension inputs follow the plain regions, in order (see extension.py).
    extended: tuple[ShardParam, ...] = ()
    wire: GatherWire = PLAIN_GATHER_WIRE  # decodes the output (see [Note: Wires] in comm.py)


class GatherInput(NamedTuple):
    """What one all-gather sends: this rank's chunk (1D), its layout and the group; ``output``:
    the gather output when the chunk was copied into its row (``AllGather.input``)."""

    source: torch.Tensor
    layout: Layout
    group: GroupInfo
    output: torch.Tensor | None = None


@dataclass
class PostForwardShard:
    """1/k of the full parameters kept after forward, for a re-gather within the k-group."""

    source: torch.Tensor  # 1D
    layout: Layout
    group: GroupInfo


class CopyOutTargets:
    """Where a unit's plain all-gather output goes, kept from one gather to the next.

    The unsharded storages are freed by resharding and re-allocated in place
    (see [Note: Parameter forms]), so the ``(W, chunk)`` views that copy-out
    writes through stay valid: built once, they save every gather the per-
    parameter views and checks (many small units spend more on those than on
    the copy). They serve while every parameter keeps the same padded tensor
    and the gather the same layout object (a dtype change builds a new one)."""

    def __init__(self, layout: Layout, num_chunks: int, params: list[ShardParam], padded: list[torch.Tensor]) -> None:
        self.layout = layout
        self.num_chunks = num_chunks
        self.padded = tuple(padded)
        self._pairs = tuple(zip(params, self.padded))
        self._storages = tuple((t.untyped_storage(), t.untyped_storage().nbytes()) for t in padded)
        if layout.flat:  # the output's front is the parameters back to back (see [Note: Flat layout])
            self.sizes, self.chunks, self._dim = [t.numel() for t in padded], list(padded), 0
        else:
            self.sizes, self.chunks, self._dim = list(layout.sizes), layout.chunk_views(padded, num_chunks), 1
        self._numel = sum(self.sizes)

    def serves(self, in_flight: AllGatherInFlight) -> bool:
        if in_flight.layout is not self.layout or in_flight.num_chunks != self.num_chunks:
            return False
        for param, padded in self._pairs:  # a loop: no generator to build, every gather
            if param.padded_unsharded is not padded:
                return False
        return True

    def fill(self, output: torch.Tensor) -> None:
        """Re-allocates the storages that resharding freed and copies the gathered
        ``output`` in, the version counters left as they were (see ``AllGather.copy_out``)."""
        for storage, nbytes in self._storages:
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)
        versions = tuple([tensor._version for tensor in self.padded])
        if self._dim == 0:  # a bucket's (W, chunk) columns are not contiguous: reshape copies them
            source = output.reshape(-1)[: self._numel]
        else:
            source = output if output.dim() == 2 else output.view(self.num_chunks, -1)
        torch.split_with_sizes_copy(source, self.sizes, dim=self._dim, out=self.chunks)
        torch._C._autograd._unsafe_set_version_counter(self.padded, versions)


def split_views(params: list[ShardParam], padded: list[torch.Tensor]) -> list[list[torch.Tensor] | None] | None:
    """Per-rank views for parameters sharded on a dim other than 0 (see layout.py)."""
    if all(p.shard_dim == 0 for p in params):
        return None
    return [p.split_views(t) for p, t in zip(params, padded)]


class WireSetting(Protocol):
    """Where a unit's all-gather finds its wire, read at every gather (``settings.UnitSettings``)."""

    gather_wire: GatherWire


class AllGather:
    """The all-gather steps of one unit's parameters, on the wire its settings name."""

    def __init__(self, spec: UnitSpec, buffers: UnitBuffers, settings: WireSetting) -> None:
        self.params = spec.params
        self.buffers = buffers
        self.settings = settings
        self.device = spec.device  # where compute and communication happen
        # An accelerator's copy-in and collective run on a side stream (see [Note: Streams] in offload.py);
        # on a CPU everything runs in order, and the gather makes no stream call at all.
        self.side_streams = self.device.type != "cpu"
        self._targets: CopyOutTargets | None = None  # the plain path's, see CopyOutTargets

    def _copy_stream(self) -> contextlib.AbstractContextManager:
        """Where the shards are cast or copied to the device and their all-gather is
        issued (see [Note: Streams] in offload.py)."""
        return offload.on_stream(self.device, offload.ALL_GATHER) if self.side_streams else offload.IN_ORDER

    def input(self, label: str, group: GroupInfo) -> GatherInput:
        """This rank's shards on the compute device, in the gather dtype (copy-in),
        and their layout. A copy-in for a plain gather over several ranks goes
        straight into this rank's row of the gather output (``GatherInput.output``):
        the collective then has no input of its own to copy, and no staging buffer
        is allocated (NCCL gathers in place; gloo skips a copy onto itself)."""
        buffers = self.buffers
        shard_buffer, gather_layout = buffers.shard_buffer, buffers.gather_layout
        if buffers.extended:
            return GatherInput(*self._input_with_extensions(label), group)
        wire = self.settings.gather_wire
        if shard_buffer.device == self.device and (not buffers.needs_cast or self._encode_casts(wire, group)):
            return GatherInput(shard_buffer, gather_layout, group)
        output = None
        if group.size > 1 and wire.in_place:
            output = wire.allocate(group.size, gather_layout.total, gather_layout.dtype, self.device)
            staged = output[group.rank]
        else:
            staged = torch.empty(gather_layout.total, dtype=gather_layout.dtype, device=self.device)
        with self._copy_stream(), trace.span("all_gather_copy_in", label):
            self.copy_in(staged)
        return GatherInput(staged, gather_layout, group, output)

    def copy_in(self, staged: torch.Tensor) -> None:
        """Writes this rank's shards into ``staged`` (1D, the gather layout), cast to the
        gather dtype: one fused cast where the layouts line up. On the copy stream."""
        buffers, gather_layout = self.buffers, self.buffers.gather_layout
        shard_buffer = buffers.shard_buffer
        if not buffers.needs_cast or gather_layout.lines_up(buffers.storage_layout):  # one fused cast
            staged.copy_(shard_buffer, non_blocking=True)
        else:
            torch._foreach_copy_(
                [gather_layout.region(staged, i, p.param_dtype) for i, p in enumerate(self.params)],
                [buffers.storage_layout.region(shard_buffer, i, p.orig_dtype) for i, p in enumerate(self.params)],
                non_blocking=True,
            )

    def _encode_casts(self, wire: GatherWire, group: GroupInfo) -> bool:
        """Whether the wire's encoding reads the shards in their own dtype, casting as it encodes
        (no copy-in pass; see ``QuantizedGather.encode``): same offsets in both layouts."""
        buffers = self.buffers
        return not wire.as_is and group.size > 1 and buffers.gather_layout.lines_up(buffers.storage_layout)

    def _input_with_extensions(self, label: str) -> tuple[torch.Tensor, Layout]:
        """The plain shards (cast) then every extension's inputs, packed as bytes
        (see [Note: Gather extensions])."""
        buffers, params = self.buffers, self.params
        plain = [(i, p) for i, p in enumerate(params) if p.extension is None]
        with self._copy_stream(), trace.span("all_gather_copy_in", label):
            inputs = [t for p in buffers.extended for t in _extension(p).inputs(p.local_shard, buffers.mp_policy)]
            layout = Layout.build(
                [p.buffer_numel for p in params] + [t.numel() for t in inputs],
                [p.param_dtype for p in params] + [t.dtype for t in inputs],
                in_bytes=True,
            )
            staged = torch.empty(layout.total, dtype=layout.dtype, device=self.device)
            first_input = len(params)
            torch._foreach_copy_(
                [layout.region(staged, i, p.param_dtype) for i, p in plain]
                + [layout.region(staged, first_input + j, t.dtype) for j, t in enumerate(inputs)],
                [buffers.storage_layout.region(buffers.shard_buffer, i, p.orig_dtype) for i, p in plain] + inputs,
                non_blocking=True,
            )
        return staged, layout

    def start(self, gather_input: GatherInput, async_op: bool, label: str) -> AllGatherInFlight:
        """Issues the collective over ``gather_input.group`` (none for a group of one)."""
        source, layout, group, output = gather_input
        extended = self.buffers.extended
        if group.size == 1:
            return AllGatherInFlight(None, source, source, layout, 1, extended)
        if not self.side_streams:
            return self._issue(gather_input, async_op, label)
        return offload.run_on_stream(self.device, offload.ALL_GATHER, self._issue, gather_input, async_op, label)

    def _issue(self, gather_input: GatherInput, async_op: bool, label: str) -> AllGatherInFlight:
        """``start``'s work on the copy stream, after the copy-in: the wire's steps (see [Note: Wires])."""
        source, layout, group, output = gather_input
        wire = self.settings.gather_wire
        if output is None:  # else the copy-in wrote this rank's chunk into its row of the output
            numel = wire.wire_numel(layout, source.numel())
            output = wire.allocate(group.size, numel, wire.wire_dtype(source.dtype), self.device)
            source = self._encode(wire, source, layout, output, group, label)
        # Flat: with the input in the output's row, the in-place form every backend takes.
        work = trace.call("all_gather", label, wire.collective, output.view(-1), source, group, async_op)
        return AllGatherInFlight(work, source, output, layout, group.size, self.buffers.extended, wire)

    def _encode(
        self,
        wire: GatherWire,
        source: torch.Tensor,
        layout: Layout,
        output: torch.Tensor | None,
        group: GroupInfo,
        label: str,
    ) -> torch.Tensor:
        """What goes on the wire for ``source`` (see ``GatherWire.encode``), under its profiler label."""
        if wire.as_is:
            return source  # nothing to encode: no label to enter
        with trace.span("all_gather_quantize", label):
            return wire.encode(source, layout, output, group)

    def join(self, gather_input: GatherInput, label: str) -> None:
        """Takes part in another rank's all-gather of this unit, into scratch
        (execution-order validation, see [Note: Execution order])."""
        source, layout, group, _ = gather_input
        if group.size > 1:
            with self._copy_stream():
                source = self._encode(self.settings.gather_wire, source, layout, None, group, label)
                scratch = torch.empty(source.numel() * group.size, dtype=source.dtype, device=self.device)
                comm.all_gather(scratch, source, group.process_group, async_op=False)
            if self.side_streams:
                offload.join_stream(self.device, offload.ALL_GATHER)

    def copy_out(self, in_flight: AllGatherInFlight, label: str) -> None:
        """Waits for ``in_flight`` and fills the unsharded parameters' storage (and
        the extensions' outputs, from which their parameters are then rebuilt)."""
        if in_flight.work is not None:
            in_flight.work.wait()
        if self.side_streams:
            offload.join_stream(self.device, offload.ALL_GATHER)
        targets = self._targets
        if targets is None or not targets.serves(in_flight):
            targets = self._targets = self._plain_targets(in_flight)
        if targets is not None:
            trace.call("copy_out", label, targets.fill, in_flight.output)
            return
        padded = [p.unsharded_storage(self.device) if p.extension is None else self._no_region() for p in self.params]
        views = split_views(self.params, padded)
        for param in in_flight.extended:
            outputs = _extension(param).outputs(in_flight.num_chunks, self.device)
            padded += outputs
            views = views + [None] * len(outputs) if views is not None else None
        # Saved activations of an earlier forward alias this storage: the refill
        # must not look like an in-place change to autograd (the versions are put back).
        refreshed = [p.unsharded_param for p in in_flight.extended if p.unsharded_param is not None]
        restored = (*padded, *refreshed)
        versions = tuple(tensor._version for tensor in restored)
        wire, output, num_chunks, layout = in_flight.wire, in_flight.output, in_flight.num_chunks, in_flight.layout
        with torch.no_grad(), trace.span("copy_out", label):
            if wire.as_is:
                wire.decode(output, num_chunks, layout, padded, views)
            else:
                with trace.span("all_gather_dequantize", label):
                    wire.decode(output, num_chunks, layout, padded, views)
            for param in in_flight.extended:
                param.rebuild_unsharded()
        torch._C._autograd._unsafe_set_version_counter(restored, versions)

    def _plain_targets(self, in_flight: AllGatherInFlight) -> CopyOutTargets | None:
        """The copy-out targets of ``in_flight`` when one fused copy serves it (no extension,
        encoding wire, every parameter split on dim 0, regions that tile), else None. Not built
        under inference mode, whose views may not be written outside it."""
        layout = in_flight.layout
        if in_flight.extended or not in_flight.wire.as_is or torch.is_inference_mode_enabled():
            return None
        if not (layout.tiles or layout.flat) or any(p.shard_dim != 0 for p in self.params):
            return None
        padded = [p.unsharded_storage(self.device) for p in self.params]
        return CopyOutTargets(layout, in_flight.num_chunks, self.params, padded)

    def _no_region(self) -> torch.Tensor:
        """An extended parameter's (empty) region among the plain ones."""
        return torch.empty(0, dtype=torch.uint8, device=self.device)

    def keep_post_forward(self, shard_size: int, group: GroupInfo) -> PostForwardShard:
        """This rank's 1/k of the gathered parameters, for a re-gather within ``group``."""
        layout = self.buffers.gather_layout.scaled(shard_size // group.size)
        kept = torch.empty(layout.total, dtype=layout.dtype, device=self.device)
        for index, param in enumerate(self.params):
            full = param.unsharded_storage(self.device)
            full = full if full.dtype == layout.dtype else full.view(layout.dtype)
            layout.region(kept, index, layout.dtype).copy_(full.view(group.size, -1)[group.rank])
        return PostForwardShard(kept, layout, group)


class BucketKey(NamedTuple):
    """What units must share to gather in one collective (see [Note: Gather buckets])."""

    group: dist.ProcessGroup
    dtype: torch.dtype
    flat: bool
    device: torch.device


def bucket_key(gather: AllGather, group: GroupInfo, offloaded: bool) -> BucketKey | None:
    """The key under which ``gather`` (over ``group``) may join a bucket, or None when it gathers alone."""
    layout = gather.buffers.gather_layout
    if group.size == 1 or offloaded or gather.buffers.extended or not gather.settings.gather_wire.joins_buckets:
        return None
    if layout.dtype == torch.uint8:
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


def gather_bucket(gathers: list[AllGather], group: GroupInfo, label: str) -> list[AllGatherInFlight]:
    """Issues one all-gather for ``gathers`` (keys equal, see ``bucket_key``) over ``group``,
    asynchronously; returns each unit's in-flight gather, its output the unit's columns."""
    device = gathers[0].device
    layouts = [g.buffers.gather_layout for g in gathers]
    starts = [0]
    for layout in layouts:
        starts.append(starts[-1] + layout.total)
    output = torch.empty(group.size, starts[-1], dtype=layouts[0].dtype, device=device)
    row = output[group.rank]
    if gathers[0].side_streams:
        work = offload.run_on_stream(device, offload.ALL_GATHER, _issue, gathers, starts, output, row, group, label)
    else:
        work = _issue(gathers, starts, output, row, group, label)
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
    label: str,
) -> comm.Waitable | None:
    """``gather_bucket``'s work on the copy stream: every copy-in, then the collective."""
    with trace.span("all_gather_copy_in", label):
        if any(g.buffers.needs_cast or g.buffers.shard_buffer.device != row.device for g in gathers):
            for gather, start, stop in zip(gathers, starts, starts[1:]):
                gather.copy_in(row[start:stop])
        else:  # one op for the whole bucket
            torch.cat([g.buffers.shard_buffer for g in gathers], out=row)
    return trace.call("all_gather", label, PLAIN_GATHER_WIRE.collective, output.view(-1), row, group, True)
