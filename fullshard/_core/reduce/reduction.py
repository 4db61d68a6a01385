"""A unit's gradients, from autograd to the sharded ``.grad``: what goes in,
the reduction pipelined behind the rest of backward, and where results land.

Autograd accumulates into the unsharded parameters. Once the unit's backward is
done (see [Note: When a unit's backward is done] in unit/group.py) ``GradIntake.take``
pops those gradients and ``submit`` hands them to the reduction pipeline (see
[Note: Reduction pipeline]); the reduced shards land in the sharded parameters'
``.grad`` (or the front end's buffer view's, in the buffer's layout), or stay a
partial result until a step that all-reduces (HSDP without all-reduce). Without
gradient sync they stay unsharded, summed in the reduce dtype. Intake and
reduction are one concept, one file: a backward walks them together.

[Note: Reduction pipeline]
A unit's gradients go through up to two collectives: reduce-scatter over the
shard axis, then all-reduce over the replicate axis (HSDP / replicate). Each is
issued asynchronously; each new unit's reduction first advances every older
one by one stage, so a unit's reduce-scatter overlaps the next unit's backward
compute and its all-reduce the one after. The end-of-backward callback drains
the queue.

Before a new reduction allocates its buffers, ``make_room`` finishes the
collective each older reduction has in flight, so at most one reduce-scatter
input (the largest buffer, a full unit) is alive at a time. A reduction holds
its collective's tensors until it waits for it, so that input lives exactly
that long on every backend (NCCL and gloo hold them too, torch's fake process
group does not): what ``fullshard plan`` counts.

Gradients are averaged over all data-parallel ranks (``ReduceOp.AVG``), which
makes a step equal to one process training on the concatenated batch. For
float16, whose range a sum can overflow, we sum pre-divided values instead.
With a custom divide factor (``set_gradient_divide_factor``) every collective
sums, and the result is the sum over all ranks divided by the factor: part of
the division before the first collective (float16 only), the rest after the
last.

The reduce-scatter input of a finished reduction is handed to the next one
when it has the same size (``SpareInput``): many small units of one shape then
allocate it once per backward instead of once each. It is handed on only once
its collective was waited for, so no collective in flight sees it rewritten
(on accelerators ``wait`` orders the compute stream after the collective, and
the next copy-in runs there), and dropped before any allocation of another
size and at the end of backward: no more memory is held than before.

HSDP accumulation without the all-reduce (``set_requires_all_reduce(False)``)
stops after the reduce-scatter: the unit keeps the partial result, and the
next reduction that all-reduces adds it in first, so one all-reduce carries
every micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import comm, offload
from ..comm import PLAIN_SCATTER_WIRE, GroupInfo, ScatterWire
from ..gather import ShardParam, UnitBuffers, UnitSpec
from ..layout import ROW_SHARDS, ShardLayout
from ..mesh import MeshInfo
from ..settings import ReduceSettings
from ..trace import ROOT, call, span


def _averaging(dtype: torch.dtype, world: int, sum_only: bool = False) -> tuple[dist.ReduceOp.RedOpType, float, float]:
    """(op, pre-divide factor, post-divide factor) for an average over ``world``
    ranks; ``sum_only``: with SUM even where AVG would do."""
    if (dtype != torch.float16 and not sum_only) or world == 1:
        return dist.ReduceOp.AVG, 1.0, 1.0
    return (dist.ReduceOp.SUM, *_split_factor(dtype, world))


def _split_factor(dtype: torch.dtype, factor: float) -> tuple[float, float]:
    """(before, after) the sum with before * after == ``factor``: float16 divides by
    about sqrt(factor) first so that the sum neither overflows nor underflows."""
    if dtype != torch.float16:
        return 1.0, factor
    pre = 1.0
    while factor % (pre * 2) == 0 and factor / pre > pre:
        pre *= 2
    return pre, factor / pre


def chunk_cat(tensors: list[torch.Tensor], out: torch.Tensor, dims: list[int] | None = None) -> None:
    """Row r of ``out`` (W, n) gets the r-th chunk of every tensor along its dim
    (``dims``, default 0), each padded with zeros to ceil(size / W) slices, cast
    to ``out``'s dtype. A chunk on a dim other than 0 is laid out contiguously
    with its padding at the end (see [Note: Unit buffers]).

    ``torch._chunk_cat`` does this in one kernel on accelerators. On CPU it
    first makes a padded copy of every tensor that does not split evenly, and an
    input-sized temporary whenever it casts (bf16 gradients reduced in fp32);
    there, one ``_foreach_copy_`` of every chunk block into its view of ``out``
    (and one ``_foreach_zero_`` of the padding) casts on the way and allocates
    nothing: one op per unit as well, and as fast (faster when it would pad).
    When nothing pads or casts, ``_chunk_cat`` makes no temporary on CPU either
    and is one op per unit (the copy-in of many small units).
    A dim other than 0 goes chunk by chunk (``_chunk_cat`` splits on one dim)."""
    dims = dims or [0] * len(tensors)
    world, offset, dtype = out.size(0), 0, out.dtype
    if not any(dims) and (not out.is_cpu or _splits_evenly(tensors, world, dtype)):
        torch._chunk_cat([t for t in tensors if t.numel()], dim=0, num_chunks=world, out=out)  # it refuses empty
        return
    targets: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    padding: list[torch.Tensor] = []
    for tensor, dim in zip(tensors, dims):
        rows = tensor.size(dim)
        if rows == 0:
            continue
        chunk_rows = -(-rows // world)
        width = chunk_rows * (tensor.numel() // rows)
        block = out[:, offset : offset + width]
        offset += width
        if dim != 0:
            chunks = tensor.chunk(world, dim)  # ceil-sized, as parameters are sharded; maybe fewer than W
            for rank, chunk in enumerate(chunks):
                block[rank, : chunk.numel()].view(chunk.shape).copy_(chunk)
                block[rank, chunk.numel() :].zero_()
            block[len(chunks) :].zero_()
            continue
        flat = tensor.reshape(-1)
        full = rows // chunk_rows  # chunks with no padding
        targets.append(block[:full])
        sources.append(flat[: full * width].view(full, width))
        if full < world:
            rest = flat[full * width :]
            targets.append(block[full, : rest.numel()])
            sources.append(rest)
            padding += [block[full, rest.numel() :], block[full + 1 :]]
    if targets:
        torch._foreach_copy_(targets, sources)
    if padding:
        torch._foreach_zero_(padding)


def _splits_evenly(tensors: list[torch.Tensor], world: int, dtype: torch.dtype) -> bool:
    """Whether every tensor splits into ``world`` equal chunks on dim 0 and has ``dtype``
    (a loop, not a generator: once per unit and step)."""
    for tensor in tensors:
        if tensor.size(0) % world or tensor.dtype != dtype:
            return False
    return True


def flat_cat(tensors: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out`` (1D) gets ``tensors`` flattened back to back, cast to its dtype, then
    zeros: FSDP1's flat gradient (see [Note: Flat layout] in layout.py)."""
    numels = [t.numel() for t in tensors]
    used = sum(numels)
    torch._foreach_copy_(list(out[:used].split(numels)), [t.reshape(-1) for t in tensors])
    out[used:].zero_()


def split_reduced(
    output: torch.Tensor,
    numels: list[int],
    dtypes: list[torch.dtype],
    move: Callable[[torch.Tensor, torch.dtype], torch.Tensor],
) -> list[torch.Tensor]:
    """The reduced shards in ``output`` (back to back, ``numels``), each moved by
    ``move(tensor, dtype)`` to where the shards live, as its gradient dtype: one
    move of the whole output (one cast or one device-to-host copy, the shards
    then views of it) when the dtypes agree, else one per shard."""
    if len(set(dtypes)) == 1:
        return list(move(output, dtypes[0]).split_with_sizes(numels))
    return [move(piece, dtype) for piece, dtype in zip(output.split_with_sizes(numels), dtypes)]


@dataclass(slots=True)
class ReductionPlan:
    """What one reduction does, decided before it starts (``plan_reduction``)."""

    shard_numels: list[int]  # each gradient's shard, back to back in the output
    shard_dims: list[int]  # the dim each gradient is chunked on
    shard: GroupInfo  # reduce-scatter over it (none for a group of one)
    replicate: GroupInfo  # then all-reduce over it (none for a group of one, or a partial result)
    reduce_dtype: torch.dtype
    settings: ReduceSettings
    final: bool  # False: stop after the reduce-scatter and keep a partial result
    partial: torch.Tensor | None  # an earlier partial result, added before the all-reduce
    # Rows, or FSDP1's flat pieces (see [Note: Flat layout] in layout.py: every parameter's gradient
    # given in order, the output the flat chunk).
    shard_layout: ShardLayout = ROW_SHARDS


def stops_partial(settings: ReduceSettings, replicate: GroupInfo) -> bool:
    """Whether a reduction under ``settings`` stops after the reduce-scatter and keeps a partial
    result (HSDP with ``set_requires_all_reduce(False)``; see the Note)."""
    return not settings.all_reduce and replicate.size > 1


def plan_reduction(
    params: list[ShardParam],
    mesh_info: MeshInfo,
    settings: ReduceSettings,
    reduce_dtype: torch.dtype,
    partial: torch.Tensor | None = None,
    shard_layout: ShardLayout = ROW_SHARDS,
) -> ReductionPlan:
    """The plan reducing gradients of ``params`` over ``mesh_info``'s groups under ``settings``."""
    return ReductionPlan(
        [p.shard_numel for p in params],
        [p.shard_dim for p in params],
        settings.scatter_group or mesh_info.shard,
        mesh_info.replicate,
        reduce_dtype,
        settings,
        not stops_partial(settings, mesh_info.replicate),
        partial,
        shard_layout,
    )


class GradReduction:
    """One unit's reduction: copy-in, collectives, then the result to ``on_done``."""

    def __init__(
        self,
        grads: list[torch.Tensor],
        plan: ReductionPlan,
        on_done: Callable[[torch.Tensor], None],
        label: str = ROOT,
        spare: SpareInput | None = None,
    ) -> None:
        """``label``: the unit's name in profiler labels (see [Note: Profiler labels]); ``spare``: where
        the reduce-scatter input comes from and goes back to (see the Note)."""
        settings, shard, reduce_dtype, final = plan.settings, plan.shard, plan.reduce_dtype, plan.final
        self._label = label
        self._on_done = on_done
        self._stages: list[Callable[[], None]] = []
        self._work: comm.Waitable | None = None
        # The collective in flight's tensors, alive until it is done (see the note above).
        self._in_flight: tuple[torch.Tensor, ...] = ()
        self._post_divide = 1.0
        self._sum = settings.divide_factor is not None
        self._sum_only = settings.sum_only
        self._post_reduce_hook = settings.post_reduce_hook if final else None
        # Copy-in: (W, shard) blocks of every gradient, one contiguous buffer.
        device = grads[0].device
        layout = plan.shard_layout  # a flat gradient is the flat chunk, padding included
        total = layout.flat_chunk if layout.flat else sum(plan.shard_numels)
        # The reduce-scatter's wire (see [Note: Wires] in comm.py); one rank scatters nothing: the engine's.
        scatter = settings.reduce_scatter if shard.size > 1 else PLAIN_SCATTER_WIRE
        self._spare = spare
        self._spare_on_wait: torch.Tensor | None = None  # the input, kept as spare once its collective is done
        # Taken first either way: a spare of another size is freed before anything is allocated.
        reused = spare.take(shard.size * total, reduce_dtype, device) if spare is not None else None
        self._output = scatter.allocate(total, reduce_dtype, device)  # 1D, shard layout
        reduced = self._output
        if shard.size > 1:
            if reused is None or not scatter.reuses_inputs:  # a user's collective allocates its own
                reused = scatter.allocate(shard.size * total, reduce_dtype, device)
            reduced = reused
        if not plan.shard_layout.flat:
            call("reduce_copy_in", self._label, chunk_cat, grads, reduced.view(shard.size, -1), plan.shard_dims)
        else:
            call("reduce_copy_in", self._label, flat_cat, grads, reduced)
        self._final_divide = 1.0
        if settings.comm_hook is not None:
            hook, state = settings.comm_hook
            self._stages = [lambda: self._run_hook(hook, state, reduced)]
            return
        if shard.size > 1:
            self._stages.append(lambda: self._reduce_scatter(shard, reduced, scatter))
        if final and plan.replicate.size > 1:
            self._stages.append(lambda: self._all_reduce(plan.replicate, plan.partial))
        if settings.divide_factor is not None:
            pre, post = _split_factor(reduce_dtype, settings.divide_factor)
            if pre != 1.0:
                reduced.div_(pre)
            # a partial result is divided once, after the all-reduce that takes it in
            self._final_divide = post if final else 1.0

    def _run_hook(self, hook: Callable[..., None], state: Any, reduced: torch.Tensor) -> None:
        """A user's communication hook (the wrapper's ``register_comm_hook``), run
        synchronously in place of the collectives and the averaging. Sharded:
        ``hook(state, grad, output)`` with the unit's padded gradient, rank r's
        shard at chunk r, to reduce-scatter into ``output``; unsharded:
        ``hook(state, grad)`` to all-reduce in place."""
        if reduced is self._output:
            hook(state, self._output)
        else:
            hook(state, reduced, self._output)

    def _reduce_scatter(self, shard: GroupInfo, reduced: torch.Tensor, scatter: ScatterWire) -> None:
        op = self._averaging_op(shard, reduced)
        self._in_flight = (self._output, reduced)
        self._work = call("reduce_scatter", self._label, scatter.collective, self._output, reduced, shard, op)
        if scatter.reuses_inputs:
            self._spare_on_wait = reduced

    def _all_reduce(self, replicate: GroupInfo, partial: torch.Tensor | None) -> None:
        if partial is not None:
            self._output.add_(partial)
        op = self._averaging_op(replicate, self._output)
        self._in_flight = (self._output,)
        with span("all_reduce", self._label):
            self._work = comm.all_reduce(self._output, replicate.process_group, op, async_op=True)

    def _averaging_op(self, group: GroupInfo, reduced: torch.Tensor) -> dist.ReduceOp.RedOpType:
        """The collective's op over ``group``; divides ``reduced`` before it and records the
        division after it (see ``_averaging``)."""
        op, pre, post = (
            (dist.ReduceOp.SUM, 1.0, 1.0) if self._sum else _averaging(self._output.dtype, group.size, self._sum_only)
        )
        if pre != 1.0:
            reduced.div_(pre)
        self._post_divide = post
        return op

    def wait_in_flight(self) -> bool:
        """Waits for the collective in flight, if any (True), without going on."""
        if self._work is None:
            return False
        self._work.wait()
        done_input, self._spare_on_wait = self._spare_on_wait, None
        if done_input is not None and self._spare is not None:
            self._spare.keep(done_input)
        self._work, self._in_flight = None, ()
        return True

    def _wait(self) -> None:
        if self.wait_in_flight() and self._post_divide != 1.0:
            self._output.div_(self._post_divide)

    def advance(self) -> bool:
        """Finishes the collective in flight and starts the next; True when all done."""
        self._wait()
        if self._stages:
            self._stages.pop(0)()
            return False
        if self._post_reduce_hook is not None:
            self._post_reduce_hook(self._output)
        if self._final_divide != 1.0:
            self._output.div_(self._final_divide)
        call("reduce_copy_out", self._label, self._on_done, self._output)
        return True


class SpareInput:
    """A finished reduce-scatter's input, kept for the next reduction of its size (see
    [Note: Reduction pipeline])."""

    __slots__ = ("_tensor", "_key")

    def __init__(self) -> None:
        self._tensor: torch.Tensor | None = None  # 1D
        self._key: tuple[int, torch.dtype, torch.device] | None = None

    def keep(self, tensor: torch.Tensor) -> None:
        self._tensor, self._key = tensor, (tensor.numel(), tensor.dtype, tensor.device)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The kept tensor if it has that size, dtype and device (else None); kept no longer either way."""
        tensor, key = self._tensor, self._key
        self._tensor = self._key = None
        return tensor if key is not None and key == (numel, dtype, device) else None

    def drop(self) -> None:
        self._tensor = self._key = None


class ReductionQueue:
    """See [Note: Reduction pipeline]."""

    def __init__(self) -> None:
        self._pending: list[GradReduction] = []
        self.spare = SpareInput()

    def make_room(self) -> None:
        """Advances older reductions one stage (call before building a new one)."""
        self._pending = [r for r in self._pending if not r.advance()]

    def submit(self, reduction: GradReduction) -> None:
        if not reduction.advance():
            self._pending.append(reduction)

    def drain(self) -> None:
        for reduction in self._pending:
            while not reduction.advance():
                pass
        self._pending = []
        self.spare.drop()

    def discard(self) -> None:
        """Drops every reduction after waiting for its collective in flight (an
        aborted step's gradients are lost; no later stage is started)."""
        for reduction in self._pending:
            reduction.wait_in_flight()
        self._pending = []
        self.spare.drop()


def per_param(params: list[ShardParam], output: torch.Tensor) -> Iterator[tuple[ShardParam, torch.Tensor]]:
    """Each parameter's region of ``output``, the shards of ``params`` back to back."""
    return zip(params, output.split([p.shard_numel for p in params]))


class GradIntake:
    """One unit's gradients between autograd and the sharded ``.grad``."""

    def __init__(self, spec: UnitSpec, buffers: UnitBuffers, settings: ReduceSettings) -> None:
        self.spec = spec  # the unit's: replaced when the unit is named
        self.buffers = buffers
        self.settings = settings  # the unit's, changed at run time
        self.queue: ReductionQueue | None = None  # the root's, from its lazy init on
        self.awaiting: set[ShardParam] = set()  # parameters whose gradient autograd has not produced yet
        self._partial: dict[ShardParam, torch.Tensor] = {}  # see [Note: Reduction pipeline]

    def expect(self) -> None:
        self.awaiting = {
            p for p in self.spec.params if p.unsharded_param is not None and p.unsharded_param.requires_grad
        }

    def take(self) -> tuple[list[ShardParam], list[torch.Tensor]]:
        """Pops this step's unsharded gradients (with what was accumulated unsynced);
        zeros for the unused trainable parameters when the unit includes them."""
        include_unused = self.settings.include_unused
        params, grads = [], []
        for param in self.spec.params:
            grad = _pop_unsharded_grad(param)
            if param.unsynced_grad is not None:
                grad = param.unsynced_grad if grad is None else param.unsynced_grad.add_(grad)
                param.unsynced_grad = None
            if grad is None and include_unused and param.sharded_param.requires_grad:
                grad = self.zero_grad(param)
            if grad is not None:
                params.append(param)
                grads.append(grad.contiguous())
        if params and self.spec.shard_layout.flat and len(params) < len(self.spec.params):
            # FSDP1's flat gradient covers every parameter: zeros for those autograd did not reach
            given = dict(zip(params, grads))
            params = list(self.spec.params)
            grads = [given[p] if p in given else self.zero_grad(p) for p in params]
        return params, grads

    def owes_reduction(self) -> bool:
        """Whether the end of backward must still reduce: gradients are pending, or
        the unit includes unused parameters (the other ranks reduce them too)."""
        include_unused = self.settings.include_unused
        return self.has_pending() or (include_unused and any(p.sharded_param.requires_grad for p in self.spec.params))

    def accumulate_unsynced(self) -> None:
        """No sync: gradients stay unsharded, summed in the reduce dtype."""
        reduce_dtype = self.buffers.reduce_dtype
        for param in self.spec.params:
            unsharded = param.unsharded_param
            if unsharded is None or unsharded.grad is None:
                continue
            if unsharded.grad.dtype == reduce_dtype and param.unsynced_grad is None:
                continue  # autograd keeps summing into .grad
            grad, unsharded.grad = _local_grad(param, unsharded.grad).to(reduce_dtype), None
            param.unsynced_grad = grad if param.unsynced_grad is None else param.unsynced_grad.add_(grad)

    def discard(self) -> None:
        """Drops every gradient not yet reduced: unsharded, accumulated unsynced, partial."""
        for param in self.spec.params:
            _pop_unsharded_grad(param)
            param.unsynced_grad = None
        self._partial.clear()

    def has_pending(self) -> bool:
        return any(
            p.unsynced_grad is not None or (p.unsharded_param is not None and p.unsharded_param.grad is not None)
            for p in self.spec.params
        )

    def zero_grad(self, param: ShardParam) -> torch.Tensor:
        """A zero unsharded gradient: joining a reduction this rank has nothing for."""
        return torch.zeros(param.unsharded_size, dtype=param.param_dtype, device=self.spec.device)

    def submit(self, params: list[ShardParam], grads: list[torch.Tensor]) -> None:
        """Starts reducing ``grads`` (of ``params``); the result lands in ``.grad``."""
        queue, spec, settings = self.queue, self.spec, self.settings
        if queue is None:
            raise AssertionError(f"{spec.name} reduced gradients before its root's lazy init")
        queue.make_room()
        partial_only = stops_partial(settings, spec.mesh_info.replicate)
        if spec.shard_layout.flat and (partial_only or self._partial):
            raise NotImplementedError(
                f"{spec.name}: a flat parameter's gradients are all-reduced in every step (no partial results)"
            )
        partial = None
        if self._partial and not partial_only:
            params, grads, partial = self._take_partial(params, grads)
        plan = plan_reduction(params, spec.mesh_info, settings, self.buffers.reduce_dtype, partial, spec.shard_layout)
        on_done = self._keep_partial if partial_only else self._accept
        reduction = GradReduction(grads, plan, lambda output: on_done(params, output), spec.label, queue.spare)
        del grads  # the copy-in holds them now; free the unsharded gradients
        queue.submit(reduction)

    def _take_partial(
        self, params: list[ShardParam], grads: list[torch.Tensor]
    ) -> tuple[list[ShardParam], list[torch.Tensor], torch.Tensor]:
        """Adds the parameters that only have a partial result (zero gradients now)
        and returns the partial results laid out like the reduction's output."""
        given = dict(zip(params, grads))
        params = [p for p in self.spec.params if p in given or p in self._partial]
        grads = [given[p] if p in given else self.zero_grad(p) for p in params]
        partial = torch.cat(
            [
                self._partial.pop(p)
                if p in self._partial
                else torch.zeros(p.shard_numel, dtype=self.buffers.reduce_dtype, device=self.spec.device)
                for p in params
            ]
        )
        return params, grads, partial

    def _keep_partial(self, params: list[ShardParam], output: torch.Tensor) -> None:
        for param, chunk in per_param(params, output):
            kept = self._partial.get(param)
            self._partial[param] = chunk if kept is None else kept.add_(chunk)

    def _grad_dtype(self, param: ShardParam) -> torch.dtype:
        return self.buffers.reduce_dtype if self.spec.keep_low_precision_grads else param.orig_dtype

    def _accept(self, params: list[ShardParam], output: torch.Tensor) -> None:
        """Adds the reduced shards (``output``: ``params``' shards back to back) to ``.grad``."""
        view = self.buffers.view
        if view is not None:
            self._accept_in_buffer_layout(view.tensor, params, output)
            return
        numels, dtypes = [p.shard_numel for p in params], [self._grad_dtype(p) for p in params]
        for param, padded in zip(params, split_reduced(output, numels, dtypes, self._to_storage)):
            sharded = param.sharded_param
            if sharded.grad is None:
                sharded.grad = param.present_gradient(padded)
            else:
                if self.spec.offload:
                    offload.wait_for_host_copies()  # the CPU adds now
                # The rows behind the gradient the user holds (a DTensor's local tensor, or the
                # front end's plain view): an elementwise add needs their elements, not their shape.
                grad = sharded.grad
                local = grad._local_tensor if isinstance(grad, DTensor) else grad
                local.add_(padded[: local.numel()].view_as(local))
            if not param.presentation.keeps_user_param:
                _run_post_accumulate_grad_hooks(sharded)
        _step_in_backward_optimizers([p.sharded_param for p in params])

    def _accept_in_buffer_layout(self, target: torch.Tensor, params: list[ShardParam], output: torch.Tensor) -> None:
        spec = self.spec
        dtype = self._grad_dtype(params[0])
        if len(params) == len(spec.params):  # every shard present: output has the buffer's layout
            full = self._to_storage(output, dtype)
        else:
            layout = self.buffers.storage_layout
            full = torch.zeros(layout.total, dtype=dtype, device=spec.storage_device)
            for param, chunk in per_param(params, output):
                start = layout.offsets[spec.params.index(param)]
                full[start : start + param.shard_numel].copy_(chunk)
        if target.grad is None:
            target.grad = full
        else:
            if spec.offload:
                offload.wait_for_host_copies()
            target.grad.add_(full)
        _step_in_backward_optimizers([target])

    def _to_storage(self, reduced: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A reduced gradient shard where the shards live: offloaded, copied to host
        memory off the compute stream (see [Note: CPU offload])."""
        spec = self.spec
        if spec.offload:
            return offload.to_host(reduced, dtype)
        if reduced.dtype == dtype and spec.storage_device == spec.device:
            return reduced  # where and as the shards are: no ``to()`` to parse, once per unit and step
        return reduced.to(spec.storage_device, dtype)


def _run_post_accumulate_grad_hooks(param: torch.Tensor) -> None:
    """Hooks registered with ``register_post_accumulate_grad_hook`` on a sharded parameter
    never fire by themselves (its gradient is written, not accumulated): they run here, once
    its reduced gradient landed, as torch's ``fully_shard`` runs them (the FSDP1 wrapper's
    parameters are views autograd does not see, in torch as here)."""
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    for hook in (hooks or {}).values():
        hook(param)


def _step_in_backward_optimizers(params: list[torch.Tensor]) -> None:
    """``torch.distributed.optim._apply_optimizer_in_backward`` attaches optimizers to
    a parameter and steps them from its AccumulateGrad hook, which never fires for
    a sharded parameter (its gradient is written, not accumulated): they step here,
    once the reduced gradient landed, and drop it, as that hook would."""
    for param in params:
        optimizers = getattr(param, "_in_backward_optimizers", ())
        for optimizer in optimizers:
            optimizer.step()
        if optimizers:
            param.grad = None


def _pop_unsharded_grad(param: ShardParam) -> torch.Tensor | None:
    unsharded = param.unsharded_param
    if unsharded is None:
        return None
    grad = unsharded.grad
    if grad is None:
        return None
    unsharded.grad = None
    return _local_grad(param, grad) if isinstance(grad, DTensor) else grad


def _local_grad(param: ShardParam, grad: torch.Tensor) -> torch.Tensor:
    """An unsharded gradient without its tensor-parallel wrapper."""
    if isinstance(grad, DTensor):
        target = tuple(grad.placements[i] if i in param.dp_dims else p for i, p in enumerate(param.tp_placements))
        if tuple(grad.placements) != target:
            grad = comm.redistribute(grad, target)
        grad = grad._local_tensor
    return grad
