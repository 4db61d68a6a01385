"""The only place in the library that calls torch.distributed collectives.

[Note: Comm spy]
Every tensor collective (``all_gather``, ``reduce_scatter``, ``all_reduce``,
``broadcast``) first hands a ``CommRecord`` (and the tensors) to the
registered listeners. Tests count calls and bytes with ``record_comms()``;
fault-injection tests mutate the input tensors from a listener; benchmarks and
``fullshard train``'s metrics total the bytes per step. No listener, no cost
beyond one empty-list check. The object collectives (``broadcast_object``,
``all_gather_objects``) and ``barrier`` serve set-up, checkpoints and checks,
not the step: they are not recorded.

Callers decide whether a collective is needed: a unit whose role has one rank
does not call in here at all (see ``GroupInfo``, the address of a collective:
a process group and this rank's place in it).

[Note: Gloo collectives]
Gloo's all-gather allocates two output-sized temporaries, and its
reduce-scatter clones the whole input and all-reduces the clone. On a gloo
group we therefore all-gather with one broadcast per rank straight into the
output (the same bytes on the wire, no temporaries, about twice as fast on
loopback), and reduce-scatter with an in-place all-reduce of the input followed
by a copy of this rank's chunk (what gloo does, minus the clone). Small units are the
exception. On more than two ranks the per-rank broadcasts' latency adds up and
gloo's single all-gather call wins, temporaries and all (at most
``GLOO_NATIVE_ALL_GATHER_BYTES`` gathered; at two ranks the two broadcasts are as
fast). On any group their reduce-scatter (a sum or an average of at most
``GLOO_GATHERED_REDUCE_SCATTER_BYTES``) all-gathers every rank's whole input and sums
this rank's chunks locally: W times the bytes, but a ring all-gather takes W-1
latency steps where gloo's ring all-reduce takes 2(W-1) (about half the time per
call at 4 ranks, ``benchmarks/bench_gloo_collectives.py``; at 2 ranks 128 small
units' step 5-10% faster end to end). The
two bounds are separate settings; measured end to end at 4 ranks, the one-call
all-gather beat the broadcasts on a loaded machine (0.53-0.67x of FSDP2's step
against 0.72-0.80x) while isolated calls on an idle one favoured the broadcasts
slightly, so both stay at 32 KiB (benchmarks/RESULTS.md, issue 24). The input of
a reduce-scatter is scratch: callers must not read it afterwards. Other
backends (NCCL) get the native collectives.

Bytes are counted as the data a rank moves through the collective: the full
(unsharded) buffer for an all-gather and a reduce-scatter, the tensor for an
all-reduce or broadcast. The ideal FSDP step therefore costs three times the
parameter bytes (all-gather in forward and in backward, one reduce-scatter).

[Note: DTensor collectives]
A DTensor's ``full_tensor()`` and ``redistribute()`` run collectives that
DTensor picks, one per mesh dim whose placement changes (full state dicts of
tensor-parallel parameters, loading a DTensor of another layout, a TP gradient
made local). They go through ``full_tensor`` / ``redistribute`` here, so the
spy sees them: one record per such mesh dim, on that dim's group, with the op
the change needs (Shard to Replicate: all-gather; Partial to Replicate:
all-reduce; Partial to Shard: reduce-scatter; Shard to another Shard:
all-to-all) and, as bytes, the global tensor divided among the mesh dims that
still shard it (exact for one sharded dim). At ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
the ranks of each of those groups first compare what they are about to run
(call, shape, dtype, both layouts) and all raise naming two differing ranks,
where a mismatch would otherwise pair the wrong tensors or hang (the same
promise as [Note: Execution order] for the units' collectives).

[Note: Wires]
A unit's all-gather is four steps, whatever carries it: allocate the output,
encode this rank's chunk (the copy-in's result) into what goes on the wire,
run the collective, decode the output into the unsharded parameters. A
``GatherWire`` is those four steps; every unit has one (``UnitSettings.gather_wire``,
never None), and the all-gather (gather/all_gather.py) calls them without asking
which one it holds:
  - ``PlainGatherWire`` (the default): the engine's own ``(W, chunk)`` output, the chunk
    as it is, ``comm.all_gather``, and ``Layout.copy_out``;
  - ``CustomGatherWire``: the user's all-gather object (``FSDPModule.set_custom_all_gather``,
    torch's ``AllGather``) allocates and gathers; the chunk travels as it is;
  - ``QuantizedWire`` (gather/codec/quantized_gather.py): block-wise codes
    (``set_all_gather_quantization``) encoded and decoded around the collective of
    the wire that carries it (plain or custom).
Each says whether its unit may share one all-gather with others (``joins_buckets``,
see [Note: Gather buckets] in gather/all_gather.py): only the plain wire may. A
tensor-subclass parameter's own all-gather (see [Note: Gather extensions]) is a
per-parameter strategy instead: one unit mixes such parameters with plain ones
in one collective, so extensions shape the chunk before the wire takes it.

The reduce-scatter has the same two carriers (``ScatterWire``: allocate, then
the collective; ``ReduceSettings.reduce_scatter``): the engine's own, which may
reuse a finished reduction's input (see [Note: Reduction pipeline]), or the
user's object (``FSDPModule.set_custom_reduce_scatter``, torch's ``ReduceScatter``).

Setters write the settings field; a unit reads it when it reaches the step it
governs, as it reads every run-time setting.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Placement

from . import compat

if TYPE_CHECKING:
    from .layout import Layout


@dataclass(frozen=True)
class GroupInfo:
    """A process group and this rank's place in it (size 1: no group needed; a mesh's:
    ``mesh.axis_group``)."""

    group: dist.ProcessGroup | None
    size: int
    rank: int

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The group of a collective over these ranks (one of size > 1 always has one)."""
        if self.group is None:
            raise AssertionError(f"a group of size {self.size} has no process group (rank {self.rank})")
        return self.group


@dataclass(frozen=True)
class CommRecord:
    op: str  # "all_gather" | "reduce_scatter" | "all_reduce" | "broadcast" | "all_to_all" (DTensors only)
    group: dist.ProcessGroup
    nbytes: int
    dtype: torch.dtype
    group_size: int


_T = TypeVar("_T")

CommListener = Callable[[CommRecord, list[torch.Tensor]], None]
_listeners: list[CommListener] = []


def add_listener(listener: CommListener) -> Callable[[], None]:
    """Registers ``listener``; returns a function that removes it."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener)


@contextlib.contextmanager
def record_comms() -> Iterator[list[CommRecord]]:
    """Collects a ``CommRecord`` for every collective issued inside the block."""
    records: list[CommRecord] = []
    remove = add_listener(lambda record, tensors: records.append(record))
    try:
        yield records
    finally:
        remove()


def _notify(op: str, group: dist.ProcessGroup, counted: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    nbytes = counted.numel() * counted.element_size()
    _notify_record(CommRecord(op, group, nbytes, counted.dtype, group.size()), tensors)


def _notify_record(record: CommRecord, tensors: list[torch.Tensor]) -> None:
    for listener in list(_listeners):
        listener(record, tensors)


def _check_alive(group: dist.ProcessGroup | None) -> None:
    # dist.is_initialized() without its property chain; the world is looked up at each call:
    # torch's threaded test harness swaps in one per thread
    if c10d._world.default_pg is None:
        raise RuntimeError(
            "fullshard needs a collective but the default process group was destroyed "
            "(torch.distributed.destroy_process_group was called); re-initialize it and "
            "shard a fresh model again (fully_shard, replicate or FullyShardedDataParallel)"
        )


class Waitable(Protocol):
    """What an asynchronous collective returns: ``dist.Work`` or several behind one."""

    def wait(self) -> Any: ...


class _Pending:
    """Several works (and a final copy) behind one ``wait()``."""

    def __init__(self, works: list[dist.Work], then: Callable[[], object] | None = None) -> None:
        self._works, self._then = works, then

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        if self._then is not None:
            self._then()
        self._works, self._then = [], None
        return True


def _finish(pending: _Pending, async_op: bool) -> _Pending | None:
    if async_op:
        return pending
    pending.wait()
    return None


# id(group) -> (the group, weakly; whether it runs on gloo). By id, not a WeakKeyDictionary:
# its ``get`` is Python code, and this is asked twice per unit and step.
_IS_GLOO: dict[int, tuple[weakref.ref[dist.ProcessGroup], bool]] = {}


def _is_gloo(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` runs on gloo, asked of torch once per group (``get_backend``
    checks membership and looks the group up on every call)."""
    known = _IS_GLOO.get(id(group))
    if known is None or known[0]() is not group:
        key = id(group)
        known = _IS_GLOO[key] = (
            weakref.ref(group, lambda _: _IS_GLOO.pop(key, None)),
            dist.get_backend(group) == "gloo",
        )
    return known[1]


# See [Note: Gloo collectives]; both bounds measured in benchmarks/RESULTS.md, issue 24.
# Gathering at most this many bytes on more than two ranks: gloo's one all-gather call
# instead of one broadcast per rank.
GLOO_NATIVE_ALL_GATHER_BYTES = 32 * 1024
# Reduce-scattering (sum or average) at most this many bytes, on any group: one all-gather
# of every rank's whole input and a local sum instead of one all-reduce.
GLOO_GATHERED_REDUCE_SCATTER_BYTES = 32 * 1024


def _latency_bound(buffer: torch.Tensor, bound: int) -> bool:
    """Whether a gloo collective over ``buffer`` (the gathered output, the reduce-scatter's
    input) is small enough that its latency, not its bytes, decides the way to run it."""
    return buffer.numel() * buffer.element_size() <= bound


# [Note: Direct collective calls]
# torch.distributed's Python functions spend a few microseconds per call before the
# process group's own method (an exception logger, argument checks, the default-group
# and coalescing look-ups): with three collectives per unit and step that is a
# measurable share of a small unit's step (benchmarks/RESULTS.md, issue 24). Where
# the process group has the ``*_single`` methods the functions end in
# (``compat.DIRECT_COLLECTIVES``), plain, non-complex tensors outside a torch-function
# mode and outside a coalescing block go to the method directly (it checks sizes and
# layout itself, as it does behind the functions); anything else takes the functions.
def _direct(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """Whether the collective can skip torch.distributed's Python (see the Note above)."""
    return (
        compat.DIRECT_COLLECTIVES
        and type(output) is torch.Tensor
        and type(input) is torch.Tensor
        and not torch._C._has_torch_function((output, input))
        and not input.is_complex()
        and group not in c10d._world.pg_coalesce_state
    )


def _finished(work: dist.Work | None, async_op: bool) -> dist.Work | None:
    if async_op:
        return work
    if work is not None:
        work.wait()
    return None


def native_all_gather(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> dist.Work | None:
    """The backend's own all-gather of ``input`` into ``output`` (group size x input)."""
    if _direct(output, input, group):
        return _finished(group.all_gather_single(output, input, compat.GATHER_OPTIONS[async_op]), async_op)
    return compat.ALL_GATHER_INTO_TENSOR(output, input, group=group, async_op=async_op)


def native_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp.RedOpType,
    group: dist.ProcessGroup,
    async_op: bool,
) -> dist.Work | None:
    """The backend's own reduce-scatter of ``input`` into ``output``."""
    if _direct(output, input, group):
        options = compat.ReduceScatterOptions()
        options.reduceOp = op
        options.asyncOp = async_op
        return _finished(group.reduce_scatter_single(output, input, options), async_op)
    return compat.REDUCE_SCATTER_TENSOR(output, input, op=op, group=group, async_op=async_op)


def all_gather(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> dist.Work | _Pending | None:
    """``output`` (group size x input, flat or ``(W, input)``) receives every rank's ``input``."""
    _check_alive(group)
    if _listeners:
        _notify("all_gather", group, output, [output, input])
    if not _is_gloo(group):
        return native_all_gather(output, input, group, async_op)
    if group.size() > 2 and _latency_bound(output, GLOO_NATIVE_ALL_GATHER_BYTES):
        return native_all_gather(output.view(-1), input, group, async_op)  # gloo: a flat output only
    chunks = output.view(group.size(), -1)  # see [Note: Gloo collectives]
    chunks[group.rank()].copy_(input.view(-1))
    works = [dist.broadcast(chunks[r], group_src=r, group=group, async_op=True) for r in range(group.size())]
    return _finish(_Pending(works), async_op)


class CustomAllGather(Protocol):
    """torch 2.14's ``AllGather`` (``FSDPModule.set_custom_all_gather``): allocates and gathers."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None: ...


class CustomReduceScatter(Protocol):
    """torch 2.14's ``ReduceScatter`` (``FSDPModule.set_custom_reduce_scatter``)."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None: ...


def custom_all_gather(
    custom: CustomAllGather, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> dist.Work | _Pending | None:
    """A user's all-gather object in place of ours: seen by the spy like ours."""
    _check_alive(group)
    if _listeners:
        _notify("all_gather", group, output, [output, input])
    work = custom(output_tensor=output, input_tensor=input, group=group, async_op=async_op)
    if not async_op:
        return None
    return work if work is not None else _Pending([])  # an object that finished before returning


def custom_reduce_scatter(
    custom: CustomReduceScatter,
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    op: dist.ReduceOp.RedOpType,
) -> _Pending:
    """A user's reduce-scatter object in place of ours, called as torch calls it (no
    ``async_op``: it returns when the result may be read); seen by the spy like ours."""
    _check_alive(group)
    if _listeners:
        _notify("reduce_scatter", group, input, [output, input])
    work = custom(output_tensor=output, input_tensor=input, group=group, op=op)
    return _Pending([work] if work is not None else [])


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    op: dist.ReduceOp.RedOpType,
    async_op: bool,
) -> dist.Work | _Pending | None:
    """``output`` receives this rank's chunk of ``input`` reduced over the group.

    ``input`` is scratch afterwards (see [Note: Gloo collectives]).
    """
    _check_alive(group)
    if _listeners:
        _notify("reduce_scatter", group, input, [output, input])
    if not _is_gloo(group):
        return native_reduce_scatter(output, input, op, group, async_op)
    if op in _LOCALLY_REDUCED and _latency_bound(input, GLOO_GATHERED_REDUCE_SCATTER_BYTES):
        return _reduce_scatter_by_all_gather(output, input, group, op, async_op)
    mine = input.view(group.size(), -1)[group.rank()]
    work = dist.all_reduce(input, op=op, group=group, async_op=True)
    return _finish(_Pending([work], then=lambda: output.copy_(mine)), async_op)


_LOCALLY_REDUCED = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)


def _reduce_scatter_by_all_gather(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp.RedOpType, async_op: bool
) -> _Pending | None:
    """Gloo, a small input: every rank's whole input in one
    all-gather, then this rank's chunks summed here (see [Note: Gloo collectives])."""
    world, rank = group.size(), group.rank()
    gathered = torch.empty(world, input.numel(), dtype=input.dtype, device=input.device)
    work = native_all_gather(gathered.view(-1), input.view(-1), group, async_op=True)

    def reduce_mine() -> None:
        torch.sum(gathered.view(world, world, -1)[:, rank], dim=0, out=output.view(-1))
        if op == dist.ReduceOp.AVG:
            output.div_(world)

    return _finish(_Pending([work] if work is not None else [], then=reduce_mine), async_op)


def default_group() -> dist.ProcessGroup:
    """The default (world) process group."""
    _check_alive(None)
    group = dist.group.WORLD
    if group is None:  # initialized implies a world group
        raise AssertionError(f"rank {dist.get_rank()}: torch.distributed is initialized without a world group")
    return group


def backend_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device ``group``'s backend communicates on first: CPU for gloo, the
    current CUDA device for NCCL (the order of the backend's registered devices)."""
    kind = compat.backend_device_types(group)[0]
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, getattr(torch, kind).current_device())


def bind_local_device(local_rank: int) -> torch.device:
    """Makes accelerator ``local_rank`` current when the default group's backend
    communicates on one (NCCL), and returns the device this rank computes on
    (CPU for gloo)."""
    kind = compat.backend_device_types()[0]
    if kind == "cpu":
        return torch.device("cpu")
    device = torch.device(kind, local_rank)
    getattr(torch, kind).set_device(device)
    return device


def device_for(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """Where a tensor now on ``device`` must be for a collective over ``group``.

    Where it is if the backend takes that device type (gloo: CPU and CUDA; a
    mixed ``cpu:gloo,cuda:nccl`` group), else the backend's own device (NCCL
    takes no CPU tensors: they go to the current CUDA device).
    """
    if device.type in compat.backend_device_types(group):
        return device
    return backend_device(group)


def all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp.RedOpType, async_op: bool
) -> dist.Work | None:
    _check_alive(group)
    if _listeners:
        _notify("all_reduce", group, tensor, [tensor])
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src_rank: int, group: dist.ProcessGroup) -> None:
    """Broadcasts from the group's rank ``src_rank`` (a group rank, not a global one)."""
    _check_alive(group)
    if _listeners:
        _notify("broadcast", group, tensor, [tensor])
    dist.broadcast(tensor, group_src=src_rank, group=group)


def broadcast_object(obj: _T, src_rank: int = 0, group: dist.ProcessGroup | None = None) -> _T:
    """``obj`` from ``src_rank`` (a global rank) on every rank of ``group`` (pickled);
    the other ranks pass a placeholder of the same type."""
    _check_alive(group)
    holder = [obj]
    dist.broadcast_object_list(holder, src=src_rank, group=group)
    return holder[0]


def all_gather_objects(obj: _T, group: dist.ProcessGroup | None = None) -> list[_T]:
    """Every rank's ``obj``, in rank order (pickled)."""
    _check_alive(group)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def first_disagreement(obj: _T, group: dist.ProcessGroup) -> tuple[int, _T, int, _T] | None:
    """``(rank, its obj, other rank, its obj)`` for the group's first rank and the first one whose
    ``obj`` differs from it (global ranks), or None when every rank of ``group`` passed the same."""
    every = all_gather_objects(obj, group)
    for index, theirs in enumerate(every):
        if theirs != every[0]:
            return dist.get_global_rank(group, 0), every[0], dist.get_global_rank(group, index), theirs
    return None


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Waits until every rank of ``group`` (default: all ranks) has arrived."""
    _check_alive(group)
    dist.barrier(group=group)


# -- DTensor collectives: see [Note: DTensor collectives] --------------------------------------
def full_tensor(value: DTensor) -> torch.Tensor:
    """``value``'s global tensor, on every rank of its mesh."""
    _before_dtensor_collectives("full_tensor", value, [Replicate()] * value.device_mesh.ndim)
    return value.full_tensor()


def redistribute(value: DTensor, placements: Sequence[Placement]) -> DTensor:
    """``value`` laid out by ``placements`` on its own mesh."""
    _before_dtensor_collectives("redistribute", value, placements)
    return value.redistribute(placements=placements)


def _dtensor_collective(source: Placement, target: Placement) -> str | None:
    """The collective that turns ``source`` into ``target`` on one mesh dim (None: a local step)."""
    if source == target or source.is_replicate():
        return None
    if source.is_partial():
        return "reduce_scatter" if target.is_shard() else "all_reduce"
    return "all_to_all" if target.is_shard() else "all_gather"


def _before_dtensor_collectives(call: str, value: DTensor, target: Sequence[Placement]) -> None:
    mesh, source = value.device_mesh, value.placements
    changes = enumerate(map(_dtensor_collective, source, target))
    dims = [(dim, op) for dim, op in changes if op is not None and mesh.size(dim) > 1]  # one rank: nothing moves
    if not dims:
        return
    _check_alive(None)
    if dist.get_debug_level() == dist.DebugLevel.DETAIL:
        _check_same_dtensor_call(call, value, target, [dim for dim, _ in dims])
    if not _listeners:
        return
    total = value.numel() * value.element_size()
    for dim, op in dims:
        sharding = [mesh.size(d) for d, p in enumerate(source) if d != dim and p.is_shard()]
        group = mesh.get_group(dim)
        record = CommRecord(op, group, total // math.prod(sharding), value.dtype, group.size())
        _notify_record(record, [value._local_tensor])


def _check_same_dtensor_call(call: str, value: DTensor, target: Sequence[Placement], dims: list[int]) -> None:
    """At DETAIL debug level, before a DTensor collective: every rank of each group involved
    is about to run the same one. See [Note: DTensor collectives].

    Raises:
        RuntimeError: two ranks differ, naming both and what each is about to run.
    """
    mine = (call, tuple(value.shape), str(value.dtype), tuple(map(repr, value.placements)), tuple(map(repr, target)))
    for dim in dims:
        differ = first_disagreement(mine, value.device_mesh.get_group(dim))
        if differ is not None:
            first, ours, other, theirs = differ
            raise RuntimeError(
                f"DTensor collectives differ across ranks: rank {first} is about to run {_describe(ours)} "
                f"but rank {other} {_describe(theirs)}. Every rank must save, load and step the same "
                "parameters in the same order"
            )


def _describe(call: tuple) -> str:
    name, shape, dtype, source, target = call
    return f"{name} of a {list(shape)} {dtype} DTensor from ({', '.join(source)}) to ({', '.join(target)})"


# -- wires: how a unit's collectives travel, see [Note: Wires] ----------------------------------
# A parameter's per-rank views inside its padded unsharded storage (sharded on a dim other than 0).
SplitViews = list[list[torch.Tensor] | None] | None


class GatherWire(Protocol):
    """See [Note: Wires]."""

    # Whether a unit on this wire may gather in one collective with others (see [Note: Gather buckets]).
    joins_buckets: bool
    # Whether the chunk travels as it is (no encoding): copy-out may then take the fused path.
    as_is: bool
    # Whether the collective's input may be this rank's row of its own output: the copy-in (or the
    # encoding) then writes there and nothing is copied onto itself (the engine's all-gather).
    in_place: bool

    @property
    def user(self) -> Any:
        """The object the user gave that allocates and gathers (named in messages); None: the engine's own."""
        ...

    @property
    def carrier(self) -> GatherWire:
        """The wire that allocates and runs the collective (itself, unless this one only encodes)."""
        ...

    def carried_by(self, carrier: GatherWire) -> GatherWire:
        """This wire's encoding on ``carrier``'s collective."""
        ...

    def wire_numel(self, layout: Layout, numel: int) -> int:
        """Elements one rank sends for a chunk of ``layout`` of ``numel`` elements."""
        ...

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype on the wire of a chunk of ``dtype``."""
        ...

    def allocate(self, group_size: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The output of a gather of ``numel`` elements per rank: ``(group_size, numel)``, or flat."""
        ...

    def encode(
        self, source: torch.Tensor, layout: Layout, output: torch.Tensor | None, group: GroupInfo
    ) -> torch.Tensor:
        """What goes on the wire for ``source`` (one chunk of ``layout``), written into this rank's row
        of ``output`` where the collective takes it in place."""
        ...

    def collective(
        self, output: torch.Tensor, input: torch.Tensor, group: GroupInfo, async_op: bool
    ) -> Waitable | None:
        """Gathers every rank's ``input`` into ``output`` (flat)."""
        ...

    def decode(
        self, output: torch.Tensor, num_chunks: int, layout: Layout, padded: list[torch.Tensor], views: SplitViews
    ) -> None:
        """Fills each parameter's padded unsharded storage (``padded``) from the gathered ``output``."""
        ...


class PlainGatherWire:
    """The engine's own all-gather of the chunk as it is (see [Note: Wires])."""

    joins_buckets = True
    as_is = True
    in_place = True
    user: Any = None

    @property
    def carrier(self) -> GatherWire:
        return self

    def carried_by(self, carrier: GatherWire) -> GatherWire:
        return carrier

    def wire_numel(self, layout: Layout, numel: int) -> int:
        return numel

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def allocate(self, group_size: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # (W, chunk): the rank blocks copy-out reads, with no view to build per gather
        return torch.empty(group_size, numel, dtype=dtype, device=device)

    def encode(
        self, source: torch.Tensor, layout: Layout, output: torch.Tensor | None, group: GroupInfo
    ) -> torch.Tensor:
        return source

    def collective(
        self, output: torch.Tensor, input: torch.Tensor, group: GroupInfo, async_op: bool
    ) -> Waitable | None:
        return all_gather(output, input, group.process_group, async_op)

    def decode(
        self, output: torch.Tensor, num_chunks: int, layout: Layout, padded: list[torch.Tensor], views: SplitViews
    ) -> None:
        layout.copy_out(output, num_chunks, padded, views)


PLAIN_GATHER_WIRE = PlainGatherWire()


class CustomGatherWire(PlainGatherWire):
    """The user's all-gather object (torch's ``AllGather``) allocates the output and gathers."""

    joins_buckets = False
    in_place = False  # the user's collective is not handed a view of its own output

    def __init__(self, user: CustomAllGather) -> None:
        self.user = user

    def allocate(self, group_size: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.user.allocate((group_size * numel,), dtype=dtype, device=device)

    def collective(
        self, output: torch.Tensor, input: torch.Tensor, group: GroupInfo, async_op: bool
    ) -> Waitable | None:
        return custom_all_gather(self.user, output, input, group.process_group, async_op)


class ScatterWire(Protocol):
    """See [Note: Wires]."""

    # Whether a finished reduction's input may serve as this one's (see [Note: Reduction pipeline]).
    reuses_inputs: bool
    # The object the user gave that allocates and reduce-scatters (named in messages); None: the engine's own.
    user: Any

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1D buffer of ``numel`` elements: the collective's input or output."""
        ...

    def collective(
        self, output: torch.Tensor, input: torch.Tensor, group: GroupInfo, op: dist.ReduceOp.RedOpType
    ) -> Waitable | None:
        """Starts reducing ``input`` over ``group`` into ``output`` (this rank's chunk); ``input`` is
        scratch afterwards."""
        ...


class PlainScatterWire:
    """The engine's own reduce-scatter (see [Note: Wires])."""

    reuses_inputs = True
    user: Any = None

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)  # size as an int: a tuple costs a third more

    def collective(
        self, output: torch.Tensor, input: torch.Tensor, group: GroupInfo, op: dist.ReduceOp.RedOpType
    ) -> Waitable | None:
        return reduce_scatter(output, input, group.process_group, op, True)


PLAIN_SCATTER_WIRE = PlainScatterWire()


class CustomScatterWire(PlainScatterWire):
    """The user's reduce-scatter object (torch's ``ReduceScatter``), called as torch calls it."""

    reuses_inputs = False  # it allocates its own

    def __init__(self, user: CustomReduceScatter) -> None:
        self.user = user

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.user.allocate((numel,), dtype=dtype, device=device)

    def collective(
        self, output: torch.Tensor, input: torch.Tensor, group: GroupInfo, op: dist.ReduceOp.RedOpType
    ) -> Waitable | None:
        return custom_reduce_scatter(self.user, output, input, group.process_group, op)
