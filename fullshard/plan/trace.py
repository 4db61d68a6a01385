"""One training step of any model, run on fake tensors: what it allocates and frees, in order, and its FLOPs.

[Note: Traced step]
``trace_step`` builds the model under torch's ``FakeTensorMode`` (CPU tensors
with shapes and no data: no memory; unlike the meta device, operators choose
the kernels a real device would, e.g. the fused attention that keeps no
attention matrix), runs forward, the loss and backward once, and records:
- every tensor storage an operator creates and the moment it dies (a dispatch
  mode sees each operator's outputs; a weak reference on the storage sees its
  end), so activations, what autograd saves, temporaries and the gradients of
  activations appear exactly when eager execution has them. Views share their
  input's storage and count nothing; the parameters and the batch exist before
  the step and are the engine's business, not the trace's.
- the unit boundaries the engine acts on, with the same triggers the engine
  uses: a unit's forward pre- and post-hook; the first gradient reaching one
  of its outputs (pre-backward) and the gradient of its inputs (post-backward,
  an identity function on the inputs); the root's post-backward at the end of
  backward.
- the gradients of parameters: once autograd accumulates one, its storage
  moves from the activations to the unit's unsharded gradients, which the
  engine takes at the unit's post-backward.
- the FLOPs of each operator torch's FLOP counter knows (matmuls, convolutions,
  attention), where they happen, so the cost model can place compute between
  the unit boundaries.
Mixed precision is traced as it runs: parameters and floating inputs in the
compute dtype. Activation checkpointing runs each block under
``torch.utils.checkpoint`` (non-reentrant), so the recomputation in backward
is traced too. ``fullshard.plan.replay`` plays the events back with the
engine's own buffers for each sharding choice.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.flop_counter import flop_registry

from .blocks import select_blocks
from .model_step import checkpoint_blocks, step_loss
from .repeats import lengthen, shorten
from .segments import Segment, fold
from .workspace import WorkspaceProbe

__all__ = ["StepTrace", "TracedUnit", "trace_step"]

# Event kinds. ("alloc" | "free", -1, bytes); ("op", -1, FLOPs); ("grad" | "grad_free", unit, bytes); ("forward_pre" |
# "forward_post" | "backward_pre", unit, 0); ("backward_post", unit, bytes of its gradients taken);
# ("backward_start" | "backward_end", -1, 0).
Event = tuple[str, int, int]


@dataclass(frozen=True)
class TracedUnit:
    """A unit: its parameters as (rows, elements per row) and whether a quantized all-gather would
    leave each exact (1-D: norms and biases; embeddings); its buffers (replicated, not sharded)."""

    name: str
    shapes: tuple[tuple[int, int], ...]
    exact: tuple[bool, ...]
    buffer_bytes: int


@dataclass(frozen=True)
class StepTrace:
    """One step at one micro-batch size, compute dtype and checkpointing choice. Units: the root
    first, then the blocks in the order forward first uses them."""

    units: tuple[TracedUnit, ...]
    events: tuple[Event, ...]
    forward_flops: int
    backward_flops: int
    saved_bytes: int  # activations alive when forward and the loss are done
    tokens: int  # the batch's tokens (its first integer tensor's elements), else its samples
    param_dtype: torch.dtype  # the model's own (that of the shards and optimizer states)

    @property
    def flops(self) -> int:
        return self.forward_flops + self.backward_flops

    @functools.cached_property
    def folded(self) -> tuple[Event | Segment, ...]:
        """The events with the model's runs folded (see [Note: Trace segments]): what a playback walks."""
        return fold(self.events)


class _Recorder(TorchDispatchMode):
    """The dispatch mode that sees each operator: its new storages and its FLOPs."""

    def __init__(self, workspaces: WorkspaceProbe | None) -> None:
        super().__init__()
        self.workspaces = workspaces
        self.events: list[Event] = []
        self.live: dict[int, int] = {}  # id(storage) -> bytes, for storages created during the step
        self.grads: dict[int, int] = {}  # id(storage) -> unit, for storages that became a parameter's gradient
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        self.flops += flops
        self.events.append(("op", -1, flops))  # every operator, its FLOPs (0 for most)
        scratch = 0
        if self.workspaces is not None and self.workspaces.wants(func, args):
            scratch = self.workspaces.bytes(func, args, kwargs)
        if scratch:
            self.events.append(("alloc", -1, scratch))  # held while the kernel runs, its outputs made
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._track(tensor, inputs)
        if scratch:
            self.events.append(("free", -1, scratch))
        return out

    def _track(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in inputs or key in self.live:
            return
        nbytes = storage.nbytes()
        self.live[key] = nbytes
        self.events.append(("alloc", -1, nbytes))
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        nbytes = self.live.pop(key)
        unit = self.grads.pop(key, None)
        if unit is None:
            self.events.append(("free", -1, nbytes))
        elif unit >= 0:  # a gradient replaced by the sum with a later one (a tied weight)
            self.events.append(("grad_free", unit, nbytes))

    def take_grad(self, tensor: torch.Tensor, unit: int) -> None:
        """``tensor`` is now a parameter's gradient: its bytes move to ``unit``'s."""
        key = id(tensor.untyped_storage())
        if key in self.live and key not in self.grads:
            self.grads[key] = unit
            self.events.append(("grad", unit, self.live[key]))

    def release_grads(self, unit: int) -> int:
        """The engine takes ``unit``'s gradients (post-backward): their bytes, now its to free."""
        keys = [key for key, owner in self.grads.items() if owner == unit]
        for key in keys:
            self.grads[key] = -1  # their end is the engine's, not an event
        return sum(self.live[key] for key in keys)


class _PostBackward(torch.autograd.Function):
    """Identity in forward; its backward is the unit's post-backward (its inputs' gradients are done)."""

    @staticmethod
    def forward(ctx: Any, on_backward: Callable[[], None], *tensors: torch.Tensor) -> Any:
        ctx.on_backward = on_backward
        return tensors if len(tensors) != 1 else tensors[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.on_backward()
        return (None, *grads)


class _UnitHooks:
    """The engine's triggers on one unit, recording events (see [Note: Traced step])."""

    def __init__(self, recorder: _Recorder, index: int, params: list[nn.Parameter]) -> None:
        self.recorder, self.index, self.params = recorder, index, params
        self.backward_started = self.backward_done = False

    def forward_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.recorder.events.append(("forward_pre", self.index, 0))
        flat = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if not flat:
            return args, kwargs
        hooked = _PostBackward.apply(self.backward_post, *flat)
        hooked = list(hooked) if isinstance(hooked, tuple) else [hooked]
        swap = dict(zip(map(id, flat), hooked))
        return tuple(swap.get(id(a), a) for a in args), kwargs

    def forward_post(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.recorder.events.append(("forward_post", self.index, 0))
        self.hook_outputs(output)

    def hook_outputs(self, output: Any) -> None:
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(self.backward_pre)

    def backward_pre(self, grad: torch.Tensor) -> None:
        if not self.backward_started:
            self.backward_started = True
            self.recorder.events.append(("backward_pre", self.index, 0))

    def backward_post(self) -> None:
        if self.backward_done:
            return
        self.backward_done = True
        self.recorder.events.append(("backward_post", self.index, self.recorder.release_grads(self.index)))
        for param in self.params:
            param.grad = None


def _unit_of(name: str, params: list[nn.Parameter], exact: list[bool], module: nn.Module) -> TracedUnit:
    shapes = tuple((p.shape[0] if p.dim() else 1, p.numel() // max(1, p.shape[0] if p.dim() else 1)) for p in params)
    buffers = sum(b.numel() * b.element_size() for b in module.buffers())
    return TracedUnit(name, shapes, tuple(exact), buffers)


def _embedding_params(model: nn.Module) -> set[int]:
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


def _units(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """(name, module, its parameters) of the root (what the blocks leave) and each block."""
    in_blocks = {id(p) for _, block in blocks for p in block.parameters()}
    root = [p for p in model.parameters() if id(p) not in in_blocks]
    return [("", model, root)] + [(name, block, list(block.parameters())) for name, block in blocks]


@contextlib.contextmanager
def _recording(recorder: _Recorder, units: list[_UnitHooks], modules: list[nn.Module]) -> Iterator[None]:
    handles = []
    for hooks, module in zip(units[1:], modules[1:]):
        handles.append(module.register_forward_pre_hook(hooks.forward_pre, with_kwargs=True))
        handles.append(module.register_forward_hook(hooks.forward_post))
    for hooks in units:
        for param in hooks.params:
            if param.requires_grad:
                handles.append(
                    param.register_post_accumulate_grad_hook(lambda p, i=hooks.index: recorder.take_grad(p.grad, i))
                )
    try:
        with recorder:
            yield
    finally:
        for handle in handles:
            handle.remove()


def trace_step(
    model_fn: Callable[[], nn.Module],
    batch_fn: Callable[[int], Any],
    micro_batch: int,
    compute_dtype: torch.dtype | None = None,
    checkpointing: bool = False,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    policy: Callable[[nn.Module], bool] | None = None,
    unit_classes: tuple[type[nn.Module], ...] | None = None,
    device: str = "cuda",
    workspaces: WorkspaceProbe | None = None,
) -> StepTrace:
    """Traces one step on fake tensors (see [Note: Traced step]); nothing is allocated.

    Args:
        model_fn: builds the model (called under torch's ``FakeTensorMode``: CPU tensors with
            shapes and no data).
        batch_fn: ``batch_fn(micro_batch)`` builds one rank's batch (also fake).
        micro_batch: samples per rank and step.
        compute_dtype: mixed precision's parameter dtype (None: the model's).
        checkpointing: activation checkpointing on every block.
        loss_fn: ``loss_fn(model, batch)`` -> scalar (default: see ``model_step.step_loss``).
        policy / unit_classes: which modules are units (default: the repeated blocks).
        device: where the step will run; on ``cpu`` the kernels' workspaces are probed (see
            [Note: Kernel workspaces]; ``workspaces`` shares one probe's cache between traces).
    """
    if device != "cpu":
        workspaces = None
    elif workspaces is None:
        workspaces = WorkspaceProbe()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = model_fn()
        batch = batch_fn(micro_batch)
        return _trace(
            model, batch, micro_batch, compute_dtype, checkpointing, loss_fn, policy, unit_classes, workspaces
        )


def _trace(
    model: nn.Module,
    batch: Any,
    micro_batch: int,
    compute_dtype: torch.dtype | None,
    checkpointing: bool,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None,
    policy: Callable[[nn.Module], bool] | None,
    unit_classes: tuple[type[nn.Module], ...] | None,
    workspaces: WorkspaceProbe | None,
) -> StepTrace:
    if not isinstance(model, nn.Module):
        raise TypeError(f"plan expects model_fn to return an nn.Module but got {type(model).__name__}")
    model.train()
    param_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    blocks = select_blocks(model, policy, unit_classes)
    exact_ids = _embedding_params(model)
    unit_list = _units(model, blocks)
    traced = [
        _unit_of(name, params, [p.dim() < 2 or id(p) in exact_ids for p in params], module)
        for name, module, params in unit_list
    ]
    if compute_dtype is not None and compute_dtype != param_dtype:
        for param in model.parameters():  # as the engine gathers them; buffers keep their dtype
            if param.is_floating_point():
                param.data = param.data.to(compute_dtype)
        batch = tree_map_only(torch.Tensor, lambda t: t.to(compute_dtype) if t.is_floating_point() else t, batch)
    if checkpointing:
        checkpoint_blocks([block for _, block in blocks], preserve_rng_state=False)
    modules = [module for _, module, _ in unit_list]
    events: list[Event] | None = None
    with shorten(model, blocks) as shortened:  # see [Note: Repeated block events]
        events = _record(model, batch, loss_fn, unit_list, modules, workspaces)
    if shortened:
        events = lengthen(events, len(blocks))
    if events is None:  # the blocks' events differ: the whole stack
        events = _record(model, batch, loss_fn, unit_list, modules, workspaces)
    backward = events.index(("backward_start", -1, 0))
    order = _forward_order(events, len(traced))
    forward_flops = sum(value for kind, _, value in events[:backward] if kind == "op")
    saved = sum(
        value if kind == "alloc" else -value for kind, _, value in events[:backward] if kind in ("alloc", "free")
    )
    return StepTrace(
        units=tuple(traced[i] for i in order),
        events=tuple(_renumber(events, order)),
        forward_flops=forward_flops,
        backward_flops=sum(value for kind, _, value in events if kind == "op") - forward_flops,
        saved_bytes=saved,  # alive when forward and the loss are done
        tokens=_tokens(batch, micro_batch),
        param_dtype=param_dtype,
    )


def _record(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None,
    unit_list: list[tuple[str, nn.Module, list[nn.Parameter]]],
    modules: list[nn.Module],
    workspaces: WorkspaceProbe | None,
) -> list[Event]:
    """The events of one forward, loss and backward (see [Note: Traced step])."""
    for tensor in tree_flatten(batch)[0]:  # a fresh step's: no gradient from an earlier recording
        if isinstance(tensor, torch.Tensor) and tensor.grad is not None:
            tensor.grad = None
    recorder = _Recorder(workspaces)
    hooks = [_UnitHooks(recorder, i, params) for i, (_, _, params) in enumerate(unit_list)]
    with _recording(recorder, hooks, modules):
        recorder.events.append(("forward_pre", 0, 0))
        loss = step_loss(model, batch, loss_fn, on_output=lambda out: _root_forward_post(recorder, hooks[0], out))
        recorder.events.append(("backward_start", -1, 0))
        loss.backward()
        del loss
        for unit in reversed(hooks):  # the end-of-backward callback: units no input gradient reached
            unit.backward_post()
        recorder.events.append(("backward_end", -1, 0))
    return recorder.events


def _tokens(batch: Any, samples: int) -> int:
    ids = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and not t.is_floating_point()]
    return ids[0].numel() if ids else samples


def _root_forward_post(recorder: _Recorder, root: _UnitHooks, output: Any) -> None:
    recorder.events.append(("forward_post", 0, 0))
    root.hook_outputs(output)


def _forward_order(events: list[Event], num_units: int) -> list[int]:
    """Unit indices in the order of their first forward (the root first); unused units last."""
    order = list(dict.fromkeys(i for kind, i, _ in events if kind == "forward_pre"))
    return order + [i for i in range(num_units) if i not in order]


def _renumber(events: list[Event], order: list[int]) -> list[Event]:
    new = {old: position for position, old in enumerate(order)}
    return [(kind, new[i] if i >= 0 else i, n) for kind, i, n in events]
