"""Per-module state and hooks: lazy root init, forward/backward transitions.

[Note: One step]
root pre-forward: lazy init (once) -> for each unit: the schedule's
pre-forward all-gather (prefetching the next unit, see [Note: Prefetch]) ->
forward -> post-forward reshard -> backward: the schedule's pre-backward
all-gather (prefetching the unit that ran before it) -> gradients ->
reduction (see [Note: When a unit's backward is done]) -> the end-of-backward
callback drains reductions and returns every unit to IDLE. Each hook makes one
call on the unit or the schedule; docs/architecture.md draws the whole step.

[Note: One unit, several modules]
``fully_shard([a, b])`` makes one unit whose forward pass runs from the first
of its modules to be called to the last: the first one's pre-forward gathers,
the others only cast their inputs, and the last one's post-forward reshards.
Every module's outputs get the pre-backward hook, as any of them may start
backward. A module that did not run is waited for until the root's forward
ends, which then finishes the pass.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from . import offload
from .common import TrainingState, UnitConfig, cast_floating, flatten_tensors, map_tensors, module_class_name
from .context import RootContext
from .exec_order import validation_enabled
from .group import ParamGroup, UnitUse
from .log import log_lazy_init

# Weak both ways: a module keeps its state alive through the hooks it holds (the
# state's methods), and the state holds its modules; a strong value here would keep
# its own weak key alive, and with it every unit, shard and process group, forever.
_STATES: weakref.WeakKeyDictionary[nn.Module, weakref.ref[ModuleState]] = weakref.WeakKeyDictionary()


def get_state(module: nn.Module) -> ModuleState | None:
    ref = _STATES.get(module)
    return None if ref is None else ref()


class _InputGradHook(torch.autograd.Function):
    """Identity whose backward tells the unit that its backward has finished.

    ``setup_context`` and ``jvp`` let it run under ``torch.func.jvp`` and
    forward-mode AD: the tangents pass through."""

    @staticmethod
    def forward(group: ParamGroup, use: UnitUse, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tensors

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.group, ctx.use = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.group.on_input_grads(ctx.use)
        return (None, None, *grads)

    @staticmethod
    def jvp(ctx: Any, group_tangent: Any, use_tangent: Any, *tangents: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tangents


# ``Function.apply`` binds its arguments through ``inspect.signature`` on every call
# when ``setup_context`` is defined (about 20 us, once per unit and forward); outside
# functorch transforms autograd's C entry point does the same work without it.
_apply_input_grad_hook = super(torch.autograd.Function, _InputGradHook).apply


def _hook_inputs(group: ParamGroup, use: UnitUse, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    if torch._C._are_functorch_transforms_active():
        return _InputGradHook.apply(group, use, *inputs)
    return _apply_input_grad_hook(group, use, *inputs)


class ModuleState:
    """The engine state of one ``fully_shard`` (or ``replicate``) call."""

    def __init__(
        self,
        modules: nn.Module | tuple[nn.Module, ...],
        group: ParamGroup | None,
        config: UnitConfig,
        device: torch.device,
        buffer_dtypes: dict[int, torch.dtype] | None = None,
    ) -> None:
        # Several modules make one unit (fully_shard([a, b])): see [Note: One unit, several modules].
        self.modules = (modules,) if isinstance(modules, nn.Module) else tuple(modules)
        self.module = self.modules[0]
        self._modules_to_run: set[nn.Module] = set()  # this forward pass's modules not yet run
        self.group = group
        self.config = config
        self.is_root: bool | None = None  # decided at lazy init
        self.ctx = RootContext()  # replaced by the root's at lazy init
        self.training_state = TrainingState.IDLE
        self.forward_prefetch: list[ModuleState] | None = None  # explicit, else implicit
        self.backward_prefetch: list[ModuleState] | None = None
        # Original dtypes of buffers cast for compute, by id of the cast tensor.
        self.buffer_dtypes = buffer_dtypes or {}
        policy = config.mp_policy
        self._cast_inputs_to = policy.param_dtype if policy.cast_forward_inputs else None
        self._output_dtype = policy.output_dtype
        self.device = device  # the mesh's: compute and collectives
        # Accelerator meshes: the step's root moves its inputs to the device (as DDP does).
        self._input_device = device if device.type != "cpu" else None
        self.in_registered_method = False
        self._use: UnitUse | None = None  # the running forward call's, from pre- to post-forward
        # ``module.compile()`` traces a module's hooks with its forward; ours gather,
        # swap parameters and hook autograd, so they run eagerly (a graph break
        # around the compiled forward), as torch's FSDP's do by default.
        pre_forward_hook = _eager_hook(self._pre_forward_hook)
        post_forward_hook = _eager_hook(self._post_forward_hook)
        for module in self.modules:
            _STATES[module] = weakref.ref(self)
            module.register_forward_pre_hook(pre_forward_hook, prepend=True, with_kwargs=True)
            module.register_forward_hook(post_forward_hook, prepend=False)

    # -- lazy initialization -------------------------------------------------------
    def lazy_init(self) -> None:
        """Makes this state the root of every state below it (once)."""
        if self.is_root is not None:
            return
        self.is_root = True
        states: list[ModuleState] = []
        for name, module in (item for root in self.modules for item in root.named_modules()):
            state = get_state(module)
            if state is None or state in states:
                continue
            if state is not self:
                if state.is_root or (state.is_root is not None and not self.config.adopts_used_units):
                    raise RuntimeError(
                        f"FSDP state has already been lazily initialized for {name}\n"
                        "FSDP requires running forward through the root module first"
                    )
                state.is_root = False
            states.append(state)
        self._init_names()  # first: the units' names are in what adopt checks
        self.ctx.adopt(list(states), validate=validation_enabled(), root_name=module_class_name(self.module))
        for state in states:
            state.ctx = self.ctx
        if self.config.cast_root_inputs and self._cast_inputs_to is None:
            self._cast_inputs_to = self.config.mp_policy.param_dtype
        log_lazy_init(module_class_name(self.module), [s.group for s in states if s.group is not None])

    def _init_names(self) -> None:
        """Names each unit and its parameters as the model names them (``set_names``)."""
        model_name = self.config.model_name
        fqns = {p: model_name(name) for root in self.modules for name, p in root.named_parameters()}
        for name, module in (item for root in self.modules for item in root.named_modules()):
            state = get_state(module)
            if state is not None and state.group is not None:
                state.group.set_names(model_name(name), fqns)

    # -- forward -------------------------------------------------------------------
    def _pre_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if len(self.modules) > 1:
            if self._modules_to_run and self.training_state is TrainingState.FORWARD:
                return self._cast_inputs(args, kwargs)  # the pass is under way: gathered already
            self._modules_to_run = set(self.modules)
        return self.pre_forward(args, kwargs)

    def _post_forward_hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if len(self.modules) > 1 and self.training_state is TrainingState.FORWARD:
            self._modules_to_run.discard(module)
            if self._modules_to_run:
                if torch.is_grad_enabled():
                    self._hook_output_grads(output, self._use)  # its backward may come first
                return self._cast_output(output)
        return self.post_forward(output)

    def abandon_step(self) -> None:
        """See ``RootContext.abandon_step``."""
        self.training_state = TrainingState.IDLE
        self._modules_to_run.clear()
        self._use = None

    def reset_iter_state(self, api: str) -> None:
        """Forgets a step an exception cut short; ``api`` names the caller in errors."""
        if self.is_root is None:
            return  # never ran: nothing to forget
        if not self.is_root:
            raise RuntimeError(
                f"{api}() must be called on the root module (the one whose forward runs first, where "
                f"fully_shard was applied last), not on {module_class_name(self.module)}"
            )
        self.ctx.abandon_step()

    def finish_forward_pass(self) -> None:
        """Ends a pass in which some of the unit's modules did not run."""
        if self._modules_to_run and self.training_state is TrainingState.FORWARD:
            self._modules_to_run.clear()
            self.post_forward(None)

    def pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.in_registered_method:  # forward called from a registered method: already gathered
            return args, kwargs
        if self.is_root and torch._C._current_graph_task_id() == -1 and self.ctx.step_cut_short:
            self._abandon_cut_short_step()
        if self.recomputing:
            if self.group is not None:
                self.group.unshard()
            return self._cast_inputs(args, kwargs)
        if self.is_root is None:
            self.lazy_init()
        if self.ctx.iteration_root is None:
            self.ctx.begin_iteration(self)
            if self.ctx.post_optim_event is not None:
                offload.wait_for_event(self.device, offload.ALL_GATHER, self.ctx.post_optim_event)
                self.ctx.post_optim_event = None
            if self._input_device is not None:
                args, kwargs = map_tensors(lambda t: t.to(self._input_device, non_blocking=True), (args, kwargs))
        self.training_state = TrainingState.FORWARD
        if self._cast_inputs_to is not None:
            args, kwargs = self._cast_inputs(args, kwargs)
        if self.config.full_precision_in_eval and self.buffer_dtypes:
            self._cast_buffers(full_precision=not self.module.training)
        group = self.group
        if group is None:
            return args, kwargs
        group.training_state = TrainingState.FORWARD
        if self.config.full_precision_in_eval:
            group.set_full_precision(not self.module.training)
        self.ctx.schedule.before_forward(self, group)
        if torch.is_grad_enabled():
            args, kwargs = self._hook_input_grads(group, args, kwargs)
        return args, kwargs

    def _abandon_cut_short_step(self) -> None:
        """A root forward outside backward found the last step stopped midway."""
        warnings.warn(
            f"the previous step of {module_class_name(self.module)} stopped midway (an exception in forward "
            "or backward?): its gradients are dropped and every unit resharded before this forward. Call "
            "reset_iter_state() on the root after catching the exception to do this explicitly.",
            stacklevel=2,
        )
        self.ctx.abandon_step()

    def post_forward(self, output: Any) -> Any:
        if self.in_registered_method:
            return output
        if self.recomputing:  # the unit's own backward reshards it
            return self._cast_output(output)
        use, self._use = self._use, None
        grad_enabled = torch.is_grad_enabled()
        if self.group is not None:
            self.group.post_forward()
            if grad_enabled:
                self.ctx.schedule.after_forward(self.group)
        if grad_enabled:
            self._hook_output_grads(output, use)
        self.training_state = TrainingState.IDLE
        if self.ctx.iteration_root is self:
            self.ctx.end_forward()
        return output if self._output_dtype is None else self._cast_output(output)

    @property
    def recomputing(self) -> bool:
        """A forward run by backward (activation checkpointing recomputes a block,
        and with it the units nested in it that have not started their backward):
        it gathers, but starts no step, registers no hooks and reshards nothing."""
        return self.training_state is TrainingState.PRE_BACKWARD or torch._C._current_graph_task_id() != -1

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self._cast_inputs_to is None or (self.config.full_precision_in_eval and not self.module.training):
            return args, kwargs
        return cast_floating(self._cast_inputs_to, args), cast_floating(self._cast_inputs_to, kwargs)

    def _cast_buffers(self, full_precision: bool) -> None:
        """Eval-mode forwards in full precision (``FSDP_USE_FULL_PREC_IN_EVAL``) compute with
        the buffers cast for compute back in their original dtype, as FSDP1 does; a train-mode
        forward casts them to ``buffer_dtype`` again. In place (``.data``): state dicts find
        them by identity."""
        for module in self.modules:
            for buffer in module.buffers():
                original = self.buffer_dtypes.get(id(buffer))
                target = original if full_precision else self.config.buffer_dtype
                if original is not None and target is not None and buffer.dtype != target:
                    buffer.data = buffer.data.to(target)

    def _cast_output(self, output: Any) -> Any:
        return output if self._output_dtype is None else cast_floating(self._output_dtype, output)

    def _hook_input_grads(self, group: ParamGroup, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        plain = not kwargs  # the common call, plain tensors only: no tree to walk (and no generator)
        for arg in args:
            if type(arg) is not torch.Tensor:
                plain = False
                break
        candidates = args if plain else flatten_tensors((args, kwargs))
        inputs = [t for t in candidates if t.requires_grad]
        if not inputs:
            return args, kwargs
        self._use = UnitUse()
        hooked = _hook_inputs(group, self._use, inputs)
        if plain:
            if len(inputs) == len(args):
                return hooked, kwargs
            rest = iter(hooked)
            return tuple(next(rest) if a.requires_grad else a for a in args), kwargs
        hooked_by_id = dict(zip(map(id, inputs), hooked))
        return map_tensors(lambda t: hooked_by_id.get(id(t), t), (args, kwargs))

    def _hook_output_grads(self, output: Any, use: UnitUse | None) -> None:
        """Every output's gradient starts ``use``'s backward (the modules of a
        grouped unit share the pass's one use)."""
        hook = _PreBackwardHook(self, use)
        outputs = [output] if type(output) is torch.Tensor else flatten_tensors(output)
        for tensor in outputs:
            if tensor.requires_grad:
                tensor.register_hook(hook)


class _PreBackwardHook:
    """The hook on a forward use's outputs: backward reached them. One small object per unit
    and forward (a partial of a bound method with a keyword is three, each one the garbage
    collector then walks)."""

    __slots__ = ("state", "use")

    def __init__(self, state: ModuleState, use: UnitUse | None) -> None:
        self.state, self.use = state, use

    def __call__(self, grad: torch.Tensor) -> None:
        state = self.state
        state.ctx.schedule.before_backward(state, self.use)


def _eager_hook(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` run eagerly when dynamo traces it (``torch.compiler.disable``: a graph
    break), called directly otherwise: the disabled wrapper swaps dynamo's frame
    callback on every call, a few microseconds per unit and hook in eager steps."""
    disabled = torch.compiler.disable(hook)

    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return hook(*args, **kwargs)

    return run
