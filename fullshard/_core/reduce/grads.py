"""What happens to a unit's gradients, from autograd to the sharded ``.grad``.

Autograd accumulates into the unsharded parameters. Once the unit's backward is
done (see [Note: When a unit's backward is done] in unit/group.py) ``take`` pops
those gradients and ``submit`` hands them to the reduction pipeline (see
[Note: Reduction pipeline]); the reduced shards land in the sharded parameters'
``.grad`` (or the front end's buffer view's, in the buffer's layout), or stay a
partial result until a step that all-reduces (HSDP without all-reduce). Without
gradient sync they stay unsharded, summed in the reduce dtype.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

from .. import comm, offload
from ..gather import ShardParam, UnitBuffers, UnitSpec
from ..settings import ReduceSettings
from .reduction import GradReduction, ReductionQueue, plan_reduction, split_reduced


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
        if params and self.spec.flat_chunk is not None and len(params) < len(self.spec.params):
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
        partial_only = settings.partial_only(spec.mesh_info.replicate)
        if spec.flat_chunk is not None and (partial_only or self._partial):
            raise NotImplementedError(
                f"{spec.name}: a flat parameter's gradients are all-reduced in every step (no partial results)"
            )
        partial = None
        if self._partial and not partial_only:
            params, grads, partial = self._take_partial(params, grads)
        plan = plan_reduction(params, spec.mesh_info, settings, self.buffers.reduce_dtype, partial, spec.flat_chunk)
        on_done = self._keep_partial if partial_only else self._accept
        reduction = GradReduction(grads, plan, lambda output: on_done(params, output), spec.labels, queue.spare)
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
                offload.wait_for_host_copies()  # the CPU adds now
                local = param.rows_from_presented(sharded.grad)
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
