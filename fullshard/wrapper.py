"""``FullyShardedDataParallel``: the FSDP1-compatible wrapper, on the same engine.

Code written for PyTorch's own FSDP1 wrapper (``FullyShardedDataParallel``) runs
after an import swap::

    torchrun --nproc-per-node 2 train.py

    from fullshard import FullyShardedDataParallel as FSDP, ShardingStrategy
    from fullshard.wrap import ModuleWrapPolicy
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                 sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_id=torch.device("cpu"))

The wrapper is the unit: its hooks gather the parameters managed for it (its
subtree minus nested wrappers) around its forward. Strategies map onto the
engine (see DESIGN.md): FULL_SHARD and HYBRID_SHARD reshard after forward
(except the root), SHARD_GRAD_OP and _HYBRID_SHARD_ZERO2 keep the parameters,
NO_SHARD replicates. With ``use_orig_params=False`` the optimizer sees one
flat parameter per unit (``_flat_param``, the unit's shard buffer itself);
with True, the user's own parameter objects, showing plain 1D views of this
rank's shard outside forward and the full tensors inside (see [Note:
Presentations] in ``_core/presentation.py``), as FSDP1 does.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from . import state_dict as state_dicts
from . import wrapper_optim_state as optim_states
from . import wrapper_summon
from ._core.common import TrainingState as EngineState
from ._core.manage import manage_module, reject_torch_fsdp, states_below
from ._core.mesh import MeshInfo
from ._core.step import ModuleState, get_state, module_class_name
from ._core.unit import register_param_unit
from ._flat_param import FlatParamView
from ._names import WRAPPED_MODULE, model_name
from .api import HYBRID_STRATEGIES, BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy, StateDictType
from .clip import clip_grad_norm_
from .state_dict.flat_param_hooks import install_flat_param_hooks
from .state_dict.model import default_settings, install_prefix_hooks, install_state_dict_hooks
from .torch_names import state_dict_api_rebound
from .wrap import Policy, PolicyFn, select_modules
from .wrapper_arguments import (
    WrapperSettings,
    materialize_meta,
    no_shard_on_one_rank,
    resolve_ignored,
    resolve_mesh,
    unit_config,
    warn_if_mixed_requires_grad,
    warn_no_shard_on_one_rank,
)

__all__ = ["FullyShardedDataParallel", "FSDP"]

# Strategies whose units stay unsharded between forward and backward, and (FSDP1) through no_sync.
_KEEPING_STRATEGIES = (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2)


class TrainingState(enum.Enum):
    """What a wrapper is doing (``FullyShardedDataParallel.training_state``), as FSDP1 reports it."""

    IDLE = enum.auto()  # between steps
    FORWARD_BACKWARD = enum.auto()  # inside a forward or backward of its unit
    SUMMON_FULL_PARAMS = enum.auto()  # inside summon_full_params (or apply)


class FullyShardedDataParallel(nn.Module):
    """Shards ``module`` (and, with an ``auto_wrap_policy``, its selected submodules).

    Args:
        module: the module to wrap.
        process_group: the group to shard over, or for the hybrid strategies a
            ``(shard_group, replicate_group)`` pair. Default: all ranks (hybrid:
            ranks of a node, see ``devices_per_node``).
        sharding_strategy: a ``ShardingStrategy`` (default FULL_SHARD).
        cpu_offload: ``CPUOffload(offload_params=True)`` keeps shards and
            gradients on the CPU.
        auto_wrap_policy: a policy from ``fullshard.wrap``; selected submodules
            are wrapped first, with the same arguments.
        backward_prefetch: when to gather the next unit in backward (None: never).
        mixed_precision: a ``MixedPrecision``.
        ignored_modules: submodules left alone (not sharded, not reduced).
        param_init_fn: called on the module to materialize meta-device
            parameters (default: ``to_empty`` then ``reset_parameters``).
        device_id: the compute device (``torch.device("cpu")``, an int, or a CUDA
            device); default: the current accelerator, else CPU.
        sync_module_states: start from rank 0's parameters and buffers, on every
            rank and replica.
        forward_prefetch: gather the next unit while the current one runs forward.
        limit_all_gathers: accepted for compatibility; at most one all-gather is
            ever prefetched, so the limit always holds.
        use_orig_params: keep the original parameter objects (plain 1D views of
            this rank's shard outside forward) instead of one flat parameter per unit.
        ignored_states: parameters or modules to ignore (instead of ``ignored_modules``).
        device_mesh: a 1D mesh, or 2D ``(replicate, shard)`` for hybrid strategies.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: inconsistent process groups / meshes for the strategy (with
            FSDP1's messages), ignored modules outside ``module``, or ``module``
            already wrapped with another strategy.
    """

    _fullshard_wrapped_name = WRAPPED_MODULE  # the engine names the wrapped module in messages
    _fsdp_wrapped_module: nn.Module

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Policy | PolicyFn | None = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Iterable[nn.Parameter | nn.Module] | None = None,
        device_mesh: DeviceMesh | None = None,
        _mesh_info: MeshInfo | None = None,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"FullyShardedDataParallel expects an nn.Module but got {type(module).__name__}")
        super().__init__()
        strategy = sharding_strategy or ShardingStrategy.FULL_SHARD
        _check_not_wrapped_differently(module, strategy)
        reject_torch_fsdp(module, "FullyShardedDataParallel")
        ignored_mods, ignored_params = resolve_ignored(
            module, ignored_modules, ignored_states, FullyShardedDataParallel
        )
        mesh_info = _mesh_info or resolve_mesh(process_group, device_mesh, strategy, auto_wrap_policy, device_id)
        requested = strategy
        strategy, mesh_info = no_shard_on_one_rank(strategy, mesh_info)
        settings = WrapperSettings(
            process_group=process_group,
            device_mesh=device_mesh,
            cpu_offload=cpu_offload,
            backward_prefetch=backward_prefetch,
            mixed_precision=mixed_precision,
            param_init_fn=param_init_fn,
            device_id=device_id,
            sync_module_states=sync_module_states,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            use_orig_params=use_orig_params,
        )
        if auto_wrap_policy is not None:
            _check_nothing_wrapped(module)
            _wrap_selected(module, auto_wrap_policy, ignored_mods, ignored_params, strategy, mesh_info, settings)
        _check_one_use_orig_params(module, use_orig_params)
        self._fsdp_wrapped_module = module
        self.sharding_strategy = strategy
        self.cpu_offload = cpu_offload or CPUOffload()
        self.mixed_precision = mixed_precision or MixedPrecision()
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.limit_all_gathers = limit_all_gathers
        self.use_orig_params = self._use_orig_params = use_orig_params
        self._fsdp_mesh_info = mesh_info
        materialize_meta(module, param_init_fn, mesh_info.device, ignored_mods)
        config = unit_config(strategy, settings)
        state = manage_module(self, mesh_info, config, ignored_params, ignored_mods)
        if use_orig_params and state.group is not None:
            for param in state.group.spec.params:  # lets clip_grad_norm_ and the scaler find its unit
                register_param_unit(param.sharded_param, state.group)
            warn_if_mixed_requires_grad(state.group.spec.params, state.group.spec.name)
        always_full = strategy is ShardingStrategy.NO_SHARD  # as FSDP1: NO_SHARD units save full state dicts
        # As FSDP1: sharded state dicts hold ShardedTensors unless the wrapper was given a device mesh.
        sharded_tensors = device_mesh is None
        install_state_dict_hooks(state, default_settings(StateDictType.FULL_STATE_DICT), always_full, sharded_tensors)
        install_prefix_hooks(self)
        # Before the engine's own pre-forward (registered first, so prepended after).
        self.register_forward_pre_hook(wrapper_summon.adopt_user_params_before_forward, prepend=True)
        if not use_orig_params and state.group is not None:
            view = FlatParamView(state.group, module)
            install_flat_param_hooks(state, view.module, view.name, view.param)
        if strategy is not requested:  # once the unit is built: its own errors come first, as in FSDP1
            warn_no_shard_on_one_rank(requested)

    # -- FSDP1 members -----------------------------------------------------------------
    def _fqn_modifiers(self) -> dict[str, str]:
        """Asked of every module by torch's state-dict API (``get_state_dict``, ``set_state_dict``, ...):
        no name of ours is left out of the keys. That API knows FSDP1 wrappers by torch's class only,
        unless ``fullshard.use_in_place_of_torch()`` pointed it at ours (see torch_names.py): as a
        plain module, ours would have its optimizer states keyed by internal names and its shards
        saved as if replicated, so it refuses instead.

        Raises:
            RuntimeError: torch's state-dict API does not know this wrapper.
        """
        if not state_dict_api_rebound():
            raise RuntimeError(
                "torch.distributed.checkpoint.state_dict (get_state_dict, set_state_dict, ...) finds FSDP1 "
                "wrappers by torch's class and would take fullshard's FullyShardedDataParallel (over "
                f"{module_class_name(self.module)}) for a plain module; call fullshard.use_in_place_of_torch() "
                "first, or use FSDP.state_dict_type with model.state_dict() and FSDP.optim_state_dict"
            )
        return {}

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    @property
    def _state(self) -> ModuleState:
        state = get_state(self)
        if state is None:  # set at the end of __init__
            raise AssertionError(f"rank {dist.get_rank()}: a FullyShardedDataParallel without its unit's state")
        return state

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The group parameters are sharded over (replicated over, for NO_SHARD)."""
        info = self._fsdp_mesh_info
        role = info.replicate if info.shard_axis is None else info.shard
        if role.group is None:  # mesh axes always have a group
            raise AssertionError(f"rank {dist.get_rank()}: the wrapper's mesh gave no process group")
        return role.group

    @property
    def world_size(self) -> int:
        """The size of ``process_group``."""
        return self.process_group.size()

    @property
    def rank(self) -> int:
        """This rank's index in ``process_group``."""
        return self.process_group.rank()

    @property
    def compute_device(self) -> torch.device:
        """Where the unit computes and communicates."""
        return self._fsdp_mesh_info.device

    @property
    def training_state(self) -> TrainingState:
        """IDLE, FORWARD_BACKWARD or SUMMON_FULL_PARAMS."""
        state = self._state
        if wrapper_summon.is_summoned(state):
            return TrainingState.SUMMON_FULL_PARAMS
        busy = state.group.training_state if state.group is not None else state.training_state
        return TrainingState.IDLE if busy is EngineState.IDLE else TrainingState.FORWARD_BACKWARD

    def _assert_state(self, state: Any) -> None:
        """FSDP1's private check, which torch's test harness (``_test_fsdp_parity``) calls: the
        unit is in ``state`` (a member, or a list of them, of ours or of torch's ``TrainingState``,
        compared by name).

        Raises:
            ValueError: it is in another state.
        """
        expected = state if isinstance(state, (list, tuple)) else [state]
        if self.training_state.name not in {s.name for s in expected}:
            raise ValueError(
                f"expected to be in states {[s.name for s in expected]} but current state is "
                f"{self.training_state.name} ({module_class_name(self.module)})"
            )

    @property
    def _inter_node_pg(self) -> dist.ProcessGroup | None:
        """The group gradients are all-reduced over between replicas (hybrid strategies)."""
        info = self._fsdp_mesh_info
        return info.replicate.group if info.shard_axis is not None else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._fsdp_wrapped_module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """Attributes the wrapper lacks come from the wrapped module (as in FSDP1)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == WRAPPED_MODULE:  # not set yet: do not recurse
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: Any) -> Any:
        wrapped: Any = self._fsdp_wrapped_module  # indexable when a container (nn.Sequential, nn.ModuleList)
        return wrapped[key]

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """As ``nn.Module``'s; inside ``summon_full_params`` the wrapper prefixes are removed."""
        return self._names_as_summoned(super().named_parameters(*args, **kwargs))

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """As ``nn.Module``'s; inside ``summon_full_params`` the wrapper prefixes are removed."""
        return self._names_as_summoned(super().named_buffers(*args, **kwargs))

    def _names_as_summoned(self, named: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The local model's names while full parameters are summoned, so that code
        written for the unwrapped model (matching names against a reference) works."""
        clean = any(wrapper_summon.is_summoned(state) for state in states_below(self))
        for name, value in named:
            yield (model_name(name) if clean else name), value

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """Calls ``fn`` on every submodule, children first, with the full parameters
        visible and written back into the shards afterwards: how FSDP1 code
        (re)initialises a wrapped model, e.g. ``model.apply(init_weights)``.

        Raises:
            ValueError: inside ``summon_full_params`` (as PyTorch's FSDP1).
        """
        global _applying
        if _applying:  # a nested wrapper, inside the enclosing wrapper's apply
            return super().apply(fn)
        if wrapper_summon.is_summoned(self._state):
            raise ValueError(
                f"apply expects no summon_full_params in progress but {module_class_name(self.module)} is "
                "summoned; call apply outside the summon_full_params block (apply summons the parameters itself)"
            )
        _applying = True
        try:
            with self.summon_full_params(self, recurse=True, writeback=True):
                return super().apply(fn)
        finally:
            _applying = False

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        result = super()._apply(*args, **kwargs)
        group = self._state.group
        if group is not None:
            group.repack_after_apply()
        return result

    def register_comm_hook(self, state: object, hook: Callable[..., None]) -> None:
        """Replaces every unit's gradient communication with ``hook`` (e.g. the
        compression hooks of ``torch.distributed.algorithms._comm_hooks``).

        Sharded strategies call ``hook(state, grad, output)``: ``grad`` is the
        unit's padded gradient (in the reduce dtype), whose ``world_size`` equal
        chunks are the ranks' shards; the hook reduce-scatters it into
        ``output`` and does any averaging itself. NO_SHARD calls
        ``hook(state, grad)``, to all-reduce ``grad`` in place. Call once, on
        the root, before the first forward.

        Raises:
            AssertionError: not the root, a unit uses a hybrid strategy (two
                collectives: no single hook fits), or a hook is already
                registered (torch's type and words, which its tests match).
            ValueError: ``hook`` is not callable.
        """
        if not callable(hook):
            raise ValueError(f"The communication hook must be callable but got {hook!r}")
        if not self.check_is_root():
            raise AssertionError("register_comm_hook can only be called on a root instance.")
        units = FullyShardedDataParallel.fsdp_modules(self)
        for unit in units:
            if unit.sharding_strategy in HYBRID_STRATEGIES:
                raise AssertionError(
                    f"Communication hook is not supported for hybrid strategies: {unit.sharding_strategy} "
                    f"({module_class_name(unit.module)} reduce-scatters and all-reduces: no single hook fits)"
                )
            if unit._state.group is not None and unit._state.group.settings.reduce.comm_hook is not None:
                raise AssertionError("A communication hook is already registered")
        for unit in units:
            if unit._state.group is not None:
                unit._state.group.settings.reduce.comm_hook = (hook, state)

    def check_is_root(self) -> bool:
        """Whether this wrapper is the root, the one whose forward starts an iteration.
        Initializes lazily first (as a forward would), so ask the outermost wrapper
        first: asked first, an inner wrapper becomes a root of its own subtree."""
        self._state.lazy_init()
        return bool(self._state.is_root)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the gradients of every parameter under this (root) wrapper by their
        global norm across shards and replicas. Returns the norm before clipping."""
        self._state.lazy_init()
        if not self._state.is_root:
            raise RuntimeError("clip_grad_norm_ expects to be called on the root FullyShardedDataParallel instance")
        if self.training_state is not TrainingState.IDLE:  # some gradients are not reduced yet
            raise ValueError(
                f"clip_grad_norm_ expects the root in TrainingState.IDLE but it is in TrainingState."
                f"{self.training_state.name}: call it after backward has finished"
            )
        return clip_grad_norm_(self.parameters(), max_norm, norm_type)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulates gradients locally (no communication) inside the block.

        Raises:
            RuntimeError: not the root wrapper (as PyTorch's FSDP1).
        """
        self._state.lazy_init()
        if not self._state.is_root:
            raise RuntimeError("no_sync expects to be called on the root FullyShardedDataParallel instance")
        groups = [s.group for s in states_below(self) if s.group is not None]
        previous = [(g.settings.requires_gradient_sync, g.settings.reshard_after_backward) for g in groups]
        # As FSDP1: the strategies that keep parameters after forward keep them through the
        # accumulation too (no all-gather per micro-batch); they are resharded after the synced backward.
        keeping = {
            id(unit._state.group)
            for unit in self.modules()
            if isinstance(unit, FullyShardedDataParallel) and unit.sharding_strategy in _KEEPING_STRATEGIES
        }
        for group in groups:
            group.settings.requires_gradient_sync = False
            group.settings.reshard_after_backward = group.settings.reshard_after_backward and id(group) not in keeping
        try:
            yield
        finally:
            for group, (sync, reshard) in zip(groups, previous):
                group.settings.requires_gradient_sync, group.settings.reshard_after_backward = sync, reshard

    summon_full_params = staticmethod(wrapper_summon.summon_full_params)

    # -- state dicts (see fullshard.state_dict) ------------------------------------------
    state_dict_type = staticmethod(state_dicts.state_dict_type)
    set_state_dict_type = staticmethod(state_dicts.set_state_dict_type)
    get_state_dict_type = staticmethod(state_dicts.get_state_dict_type)

    # -- optimizer state dicts (see wrapper_optim_state.py) -------------------------------
    optim_state_dict = staticmethod(optim_states.optim_state_dict)
    optim_state_dict_to_load = staticmethod(optim_states.optim_state_dict_to_load)
    full_optim_state_dict = staticmethod(optim_states.full_optim_state_dict)
    sharded_optim_state_dict = staticmethod(optim_states.sharded_optim_state_dict)
    shard_full_optim_state_dict = staticmethod(optim_states.shard_full_optim_state_dict)
    scatter_full_optim_state_dict = staticmethod(optim_states.scatter_full_optim_state_dict)
    flatten_sharded_optim_state_dict = staticmethod(optim_states.flatten_sharded_optim_state_dict)
    rekey_optim_state_dict = staticmethod(optim_states.rekey_optim_state_dict)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """The wrappers in ``module``'s tree (only the outermost ones with ``root_only``)."""
        wrappers = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if not root_only:
            return wrappers
        nested = {id(inner) for w in wrappers for inner in w.module.modules() if inner is not w}
        return [w for w in wrappers if id(w) not in nested]


FSDP = FullyShardedDataParallel

_applying = False  # inside a wrapper's apply: the wrappers below it run nn.Module.apply


def _check_not_wrapped_differently(module: nn.Module, strategy: ShardingStrategy) -> None:
    if isinstance(module, FullyShardedDataParallel) and module.sharding_strategy is not strategy:
        raise ValueError(
            f"FullyShardedDataParallel expects a module not already wrapped with another strategy, but "
            f"{module_class_name(module.module)} is wrapped with {module.sharding_strategy.name} and "
            f"{strategy.name} was requested; wrap the unwrapped module once"
        )


def _check_one_use_orig_params(module: nn.Module, use_orig_params: bool) -> None:
    """Wrappers under one root share use_orig_params: the optimizer and the
    state dicts see either flat or original parameters, not a mix."""
    for nested in module.modules():
        made = isinstance(nested, FullyShardedDataParallel) and get_state(nested) is not None
        if made and nested.use_orig_params != use_orig_params:
            raise ValueError(
                f"FullyShardedDataParallel expects one use_orig_params for all wrappers, but "
                f"{module_class_name(module)} gets use_orig_params={use_orig_params} and its nested wrapper "
                f"of {module_class_name(nested)} has use_orig_params={not use_orig_params}"
            )


def _check_nothing_wrapped(module: nn.Module) -> None:
    """An auto-wrap policy decides every unit below the root, so no module there may be a
    unit already (FSDP1's rule; ``wrap()`` and manual wrapping nest units freely).

    Raises:
        ValueError: naming the first module that already is a unit.
    """
    for name, submodule in module.named_modules():
        if get_state(submodule) is not None:
            raise ValueError(
                "FSDP auto wrapping requires modules to not already have FSDP applied but found "
                f"{name or type(module).__name__} in {type(module).__name__} (a {type(submodule).__name__} unit); "
                "wrap the plain model with the policy alone, or nest units without auto_wrap_policy"
            )


def _wrap_selected(
    module: nn.Module,
    policy: Policy | PolicyFn,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    strategy: ShardingStrategy,
    mesh_info: MeshInfo,
    settings: WrapperSettings,
) -> None:
    """Wraps the submodules ``policy`` selects (children first) in place.

    They share the root's groups, unless a ``CustomPolicy`` override changes
    the strategy or the groups; then they resolve their own like the root.
    """
    parents: dict[int, list[tuple[nn.Module, str]]] = {}
    for parent in module.modules():
        for name, child in parent.named_children():
            parents.setdefault(id(child), []).append((parent, name))
    for child, overrides in select_modules(module, policy, ignored_modules):
        child_strategy = overrides.get("sharding_strategy", strategy)
        child_mesh = mesh_info
        if {"sharding_strategy", "process_group", "device_mesh"} & set(overrides):
            child_mesh = resolve_mesh(
                overrides.get("process_group", settings.process_group),
                overrides.get("device_mesh", settings.device_mesh),
                child_strategy,
                policy,
                settings.device_id,
            )
        below = set(child.modules())
        ignored_below: list[nn.Module | nn.Parameter] = [m for m in ignored_modules if m in below]
        ignored_below += [p for p in ignored_params if any(p is q for q in child.parameters())]
        kwargs = {
            **settings.inherited(),
            **{k: v for k, v in overrides.items() if k not in ("process_group", "device_mesh")},
            "sharding_strategy": child_strategy,
            "ignored_states": ignored_below or None,
            "_mesh_info": child_mesh,
            # Only what decides the state-dict form (the mesh is child_mesh): FSDP1's children see the root's.
            "device_mesh": None if "process_group" in overrides else overrides.get("device_mesh", settings.device_mesh),
        }
        wrapper = FullyShardedDataParallel(child, **kwargs)
        for parent, name in parents.get(id(child), []):
            setattr(parent, name, wrapper)
