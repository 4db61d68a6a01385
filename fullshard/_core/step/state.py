"""Per-module state and hooks (forward/backward transitions), the root's lazy init
(with the check that the ranks sharded the same model, [Note: Ranks agree on the
model] below), what the units under one root share (its context), and the lazy
init's log.

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

[Note: Root context]
The root's lazy init puts every state below it, and their units, under one
``RootContext`` (FSDP2's per-root state context): the schedule that orders
their gathers and prefetches (schedule.py, see [Note: Prefetch]), the
reduction queue each unit is handed when it joins (see [Note: Reduction
pipeline]), and the end-of-backward callback. The context knows the units; a
unit knows only the schedule, as its ``UnitRoot``.

[Note: Logging]
All of fullshard logs under ``logging.getLogger("fullshard")`` (this module
uses its child ``fullshard.init`` for what lazy initialisation built) and only at DEBUG: at the default level
nothing is printed. At DEBUG, lazy initialisation (the root's first forward)
logs the mesh, then one line per unit (parameters, numel, bytes, dtypes,
offload, resharding) and one with the unit's bytes per step, counted as
``comm.record_comms()`` counts them (the full buffer for an all-gather and a
reduce-scatter, the shard for an all-reduce).
"""

from __future__ import annotations

import hashlib
import logging
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable

from .. import comm, offload
from ..common import TrainingState, cast_floating, flatten_tensors, map_tensors
from ..mesh import MeshInfo
from ..reduce import ReductionQueue
from ..settings import UnitConfig
from ..unit import ParamGroup, UnitUse, outside_transforms
from .exec_order import CheckedSchedule
from .schedule import Schedule, ScheduledState


def module_class_name(module: nn.Module) -> str:
    """The user's class name, also after fully_shard swapped the class or a front
    end's wrapper stands in front of it (a wrapper class names the child it wraps
    in ``_fullshard_wrapped_name``)."""
    wrapped_name = getattr(type(module), "_fullshard_wrapped_name", None)
    wrapped = getattr(module, "_modules", {}).get(wrapped_name) if wrapped_name else None
    if wrapped is not None:
        return module_class_name(wrapped)
    cls = type(module)
    return getattr(cls, "_fullshard_original_class", cls).__name__


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
        self.name = module_class_name(self.module)  # the user's class name, for messages and logs
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
        validate = dist.is_initialized() and dist.get_debug_level() == dist.DebugLevel.DETAIL  # [Note: Execution order]
        self.ctx.adopt(list(states), validate=validate, root_name=self.name)
        for state in states:
            state.ctx = self.ctx
        if self.config.cast_root_inputs and self._cast_inputs_to is None:
            self._cast_inputs_to = self.config.mp_policy.param_dtype
        log_lazy_init(self.name, [s.group for s in states if s.group is not None])

    def _init_names(self) -> None:
        """Names each unit and its parameters as the model names them (``set_names``)."""
        model_name = self.config.name_in_model
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
                f"{self.config.api_name} was applied last), not on {self.name}"
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
            f"the previous step of {self.name} stopped midway (an exception in forward "
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


class ContextState(ScheduledState, Protocol):
    """What the context reads of a module state under it (``state.ModuleState``)."""

    @property
    def modules(self) -> tuple[nn.Module, ...]: ...

    def finish_forward_pass(self) -> None: ...

    def abandon_step(self) -> None: ...


class RootContext:
    """See the module docstring. A module's context before its root's lazy init holds only what
    the user set on it and an empty reduction queue; the schedule is made when a root adopts its units."""

    schedule: Schedule

    def __init__(self) -> None:
        self.reductions = ReductionQueue()
        self.all_states: list[ContextState] = []
        self.iteration_root: ContextState | None = None
        self.end_of_backward_queued = False
        # False: this backward is not the step's last (micro-batching); its end leaves
        # reductions in flight instead of waiting, and keeps the prefetch order.
        self.is_last_backward = True
        # FSDPModule.set_post_optim_event's event: the next all-gather waits for it, once.
        self.post_optim_event: torch.Event | None = None
        self._units: list[ParamGroup] = []
        self._offloads = False
        self._grouped_states: list[ContextState] = []

    def adopt(self, states: list[ContextState], validate: bool, root_name: str) -> None:
        """Puts ``states`` (the root's first) and their units under this context, once every
        rank agrees on them (see [Note: Ranks agree on the model]); ``validate``: check the
        execution order (see [Note: Execution order])."""
        self.all_states = states
        self.schedule = Schedule(self.queue_end_of_backward)
        # Only a unit over several modules can end a forward with some not run (see finish_forward_pass).
        self._grouped_states = [s for s in states if len(s.modules) > 1]
        self._units = [s.group for s in states if s.group is not None]
        self._offloads = any(unit.spec.offload for unit in self._units)  # gradients copied to the host
        if self._units:
            mesh_info = self._units[0].spec.mesh_info
            on_root_ranks = [u for u in self._units if on_the_same_ranks(mesh_info, u.spec.mesh_info)]
            check_ranks_agree_on_units(root_name, mesh_info, [unit.describe() for unit in on_root_ranks])
        gate = None
        if validate:
            checked = CheckedSchedule(self.queue_end_of_backward, self._units)
            self.schedule, gate = checked, checked.gate_reduction
        for unit in self._units:
            unit.join_root(self.schedule, self.reductions, gate)
        root_unit = states[0].group
        # Unless the user chose: the root keeps its parameters (backward needs them first).
        if root_unit is not None and not root_unit.settings.reshard_after_forward_chosen:
            root_unit.settings.reshard_after_forward = False

    # -- forward ---------------------------------------------------------------------
    def begin_iteration(self, root: ContextState) -> None:
        self.iteration_root = root
        self.schedule.begin_iteration()

    def end_forward(self) -> None:
        """Finishes passes some of whose modules did not run, and reshards units
        whose prefetch went unused (the order changed)."""
        for state in self._grouped_states:
            if state is not self.iteration_root:
                state.finish_forward_pass()
        self.schedule.end_forward()
        self.iteration_root = None

    # -- backward --------------------------------------------------------------------
    def queue_end_of_backward(self) -> None:
        if not self.end_of_backward_queued:
            self.end_of_backward_queued = True
            Variable._execution_engine.queue_callback(self.end_of_backward)

    def end_of_backward(self) -> None:
        for state in self.all_states:
            if state.group is not None:
                state.group.finalize_backward()
            state.training_state = TrainingState.IDLE
        self.schedule.end_backward(self.is_last_backward)
        self.end_of_backward_queued = False
        if self.is_last_backward:
            self.reductions.drain()
            if self._offloads:
                offload.wait_for_host_copies()  # offloaded gradients readable by the CPU optimizer

    def abandon_step(self) -> None:
        """Forgets a step an exception cut short in forward or backward: waits for the
        collectives in flight, drops its reductions and gradients, reshards every
        unit and starts the next step afresh (``FSDPModule.reset_iter_state``)."""
        self.reductions.discard()
        offload.wait_for_host_copies()
        for state in self.all_states:
            state.abandon_step()
        for unit in self._units:
            unit.abandon_step()
        self.schedule.abandon_step()
        self.iteration_root = None
        self.end_of_backward_queued = False  # autograd drops the callback of a failed backward

    @property
    def step_cut_short(self) -> bool:
        """Whether a forward or backward under this root stopped midway (an exception):
        seen when the root's next forward starts."""
        return self.end_of_backward_queued or any(
            state.training_state is TrainingState.FORWARD for state in self.all_states
        )


logger = logging.getLogger("fullshard.init")


def log_lazy_init(root_name: str, groups: list[ParamGroup]) -> None:
    """The DEBUG lines of one root's lazy initialisation."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    logger.debug("lazy init of root %s: %d units", root_name, len(groups))
    meshes: list[MeshInfo] = []
    for group in groups:
        if all(group.spec.mesh_info is not seen for seen in meshes):
            meshes.append(group.spec.mesh_info)
            _log_mesh(group.spec.mesh_info)
        _log_unit(group)


def _log_mesh(mesh_info: MeshInfo) -> None:
    mesh = mesh_info.mesh
    logger.debug(
        "mesh %s (dims %s) on %s: shard group %d ranks, replicate group %d ranks",
        tuple(mesh.shape),
        mesh.mesh_dim_names,
        mesh_info.device,
        mesh_info.shard.size,
        mesh_info.replicate.size,
    )


def _log_unit(group: ParamGroup) -> None:
    params = group.spec.params
    numel = sum(p.global_size.numel() for p in params)
    full_bytes = sum(p.global_size.numel() * p.orig_dtype.itemsize for p in params)
    shard_bytes = group.buffers.shard_buffer.numel() * group.buffers.shard_buffer.element_size()
    logger.debug(
        "unit %s: %d parameters, %d elements, %d bytes (%d per rank sharded), dtypes %s, compute dtype %s, "
        "reduce dtype %s, offload %s, reshard after forward %s",
        group.spec.name,
        len(params),
        numel,
        full_bytes,
        shard_bytes,
        sorted({str(p.orig_dtype) for p in params}),
        sorted({str(p.param_dtype) for p in params}),
        group.buffers.reduce_dtype,
        group.spec.offload,
        group.settings.reshard_after_forward,
    )
    shard, replicate = group.spec.mesh_info.shard, group.spec.mesh_info.replicate
    gather_layout = group.buffers.gather_layout
    gather_bytes = gather_layout.total * gather_layout.dtype.itemsize * shard.size
    grad_numel = sum(p.shard_numel for p in params if p.sharded_param.requires_grad)
    reduce_bytes = grad_numel * group.buffers.reduce_dtype.itemsize
    num_gathers = (1 + int(group.settings.reshard_after_forward)) if shard.size > 1 else 0
    logger.debug(
        "unit %s bytes per step: all-gather %d (%d calls), reduce-scatter %d, all-reduce %d",
        group.spec.name,
        gather_bytes * num_gathers,
        num_gathers,
        reduce_bytes * shard.size if shard.size > 1 and grad_numel else 0,
        reduce_bytes if replicate.size > 1 and grad_numel else 0,
    )


# [Note: Ranks agree on the model]
# Ranks that built different models, or sharded the same one differently, issue
# collectives of different sizes: gloo aborts the process ("Received data size
# doesn't match"), NCCL hangs or reads garbage. At the root's lazy init, before
# the first all-gather, the ranks of the root unit's groups compare a digest of
# every unit they manage (its path, its parameters' names, shapes and dtypes,
# its resharding and mixed-precision settings); on a mismatch they exchange the
# full descriptions and every rank raises, naming the first unit and the two
# ranks that differ. One small collective per group, once per root. Units over
# other ranks than the root unit's (experts on a sub-mesh of their own) are left
# out: there the ranks of the root's groups may rightly hold different units.


def _first_difference(ours: list[tuple], theirs: list[tuple], rank: int, other_rank: int) -> str:
    """The first unit where two ranks' descriptions differ, in words."""
    on = f"on rank {rank}", f"on rank {other_rank}"
    for index in range(max(len(ours), len(theirs))):
        if index >= len(ours) or index >= len(theirs):
            longer, where = (theirs, on[1]) if len(theirs) > len(ours) else (ours, on[0])
            return f"unit {longer[index][0]!r} (and any after it) is sharded {where} only"
        (name, params, settings), (other_name, other_params, other_settings) = ours[index], theirs[index]
        if name != other_name:
            return f"the units' order reaches {name!r} {on[0]} where it reaches {other_name!r} {on[1]}"
        if params != other_params:
            for mine, other in zip(params, other_params):
                if mine != other:
                    return f"unit {name!r} holds {_param(mine)} {on[0]} and {_param(other)} {on[1]}"
            return f"unit {name!r} holds {len(params)} parameters {on[0]} and {len(other_params)} {on[1]}"
        if settings != other_settings:
            mine, other = next((a, b) for a, b in zip(settings, other_settings) if a != b)
            return f"unit {name!r} has {mine} {on[0]} and {other} {on[1]}"
    return "their units differ"


def _param(description: tuple) -> str:
    fqn, shape, dtype = description
    return f"{fqn} {list(shape)} {dtype}"


def on_the_same_ranks(mesh_info: MeshInfo, other: MeshInfo) -> bool:
    """Whether two units' shard and replicate groups span the same ranks."""

    def ranks(group: dist.ProcessGroup | None) -> list[int]:
        return [] if group is None else dist.get_process_group_ranks(group)

    return all(
        ranks(mine.group) == ranks(theirs.group)
        for mine, theirs in ((mesh_info.shard, other.shard), (mesh_info.replicate, other.replicate))
    )


@outside_transforms  # a lazy init under torch.func.jvp: the object collectives' tensors stay plain
def check_ranks_agree_on_units(root_name: str, mesh_info: MeshInfo, ours: list[tuple]) -> None:
    """See [Note: Ranks agree on the model]. ``ours``: each unit's ``ParamGroup.describe()``,
    in the root's order; ``mesh_info``: the root unit's.

    Raises:
        RuntimeError: on every rank of a group whose ranks differ.
    """
    digest = hashlib.sha1(repr(ours).encode()).hexdigest()
    for info in (mesh_info.shard, mesh_info.replicate):
        group = info.group
        if info.size == 1 or group is None or dist.get_backend(group) == "fake":
            continue
        if comm.first_disagreement(digest, group) is None:
            continue
        every = comm.all_gather_objects(ours, group)
        other = next(index for index, theirs in enumerate(every) if theirs != every[0])
        first, other_rank = dist.get_global_rank(group, 0), dist.get_global_rank(group, other)
        raise RuntimeError(
            f"the ranks sharded different models under {root_name}: ranks {first} and {other_rank} differ "
            f"({_first_difference(every[0], every[other], first, other_rank)}). Every rank must build the same "
            "model and apply fully_shard (or FullyShardedDataParallel) to the same modules with the same settings"
        )
