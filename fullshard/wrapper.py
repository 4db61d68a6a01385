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
import dataclasses
import enum
import os
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from . import state_dict as state_dicts
from ._core import comm
from ._core.common import TrainingState as UnitState
from ._core.common import UnitConfig, map_tensors, module_class_name
from ._core.full_params import adopt_user_params, full_params
from ._core.init import get_managed_modules
from ._core.manage import manage_module, states_below
from ._core.mesh import MeshInfo, default_device_type, default_mesh, describe_mesh, hybrid_mesh, mesh_from_groups
from ._core.presentation import LocalViews
from ._core.state import ModuleState, get_state
from ._flat_param import UNIT_ATTR, FlatParamView
from ._names import WRAPPED_MODULE, model_name
from .api import (
    HYBRID_STRATEGIES,
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FullOptimStateDictConfig,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    OptimStateKeyType,
    ShardingStrategy,
    StateDictType,
)
from .clip import clip_grad_norm_
from .state_dict import default_settings, install_flat_param_hooks, install_prefix_hooks, install_state_dict_hooks
from .wrap import Policy, PolicyFn, select_modules

__all__ = ["FullyShardedDataParallel", "FSDP"]


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
        ignored_mods, ignored_params = _resolve_ignored(module, ignored_modules, ignored_states)
        mesh_info = _mesh_info or _resolve_mesh(process_group, device_mesh, strategy, auto_wrap_policy, device_id)
        strategy, mesh_info = _no_shard_on_one_rank(strategy, mesh_info)
        settings = _Settings(
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
        _materialize_meta(module, param_init_fn, mesh_info.device, ignored_mods)
        config = _unit_config(strategy, settings)
        state = manage_module(self, mesh_info, config, ignored_params, ignored_mods)
        if use_orig_params and state.group is not None:
            for param in state.group.spec.params:  # lets clip_grad_norm_ and the scaler find its unit
                setattr(param.sharded_param, UNIT_ATTR, state.group)
            _warn_if_mixed_requires_grad(state.group.spec.params, state.group.spec.name)
        install_state_dict_hooks(state, default_settings(StateDictType.FULL_STATE_DICT))
        install_prefix_hooks(self)
        if use_orig_params:  # before the engine's own pre-forward (registered first, so prepended after)
            self.register_forward_pre_hook(_adopt_user_params, prepend=True)
        if config.flat_param and state.group is not None:
            FlatParamView(state.group, module)
            install_flat_param_hooks(state)

    # -- FSDP1 members -----------------------------------------------------------------
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
        if state in _summoned:
            return TrainingState.SUMMON_FULL_PARAMS
        busy = state.group.training_state if state.group is not None else state.training_state
        return TrainingState.IDLE if busy is UnitState.IDLE else TrainingState.FORWARD_BACKWARD

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
        clean = any(state in _summoned for state in states_below(self))
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
        if self._state in _summoned:
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
            group.buffers.rebind(group.spec.name)
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
            RuntimeError: not the root, a hook is already registered, or a unit
                uses a hybrid strategy (two collectives: no single hook fits).
            TypeError: ``hook`` is not callable.
        """
        if not callable(hook):
            raise TypeError(f"register_comm_hook expects a callable hook but got {hook!r}")
        if not self.check_is_root():
            raise RuntimeError("register_comm_hook must be called on the root FullyShardedDataParallel instance")
        units = FullyShardedDataParallel.fsdp_modules(self)
        for unit in units:
            if unit.sharding_strategy in HYBRID_STRATEGIES:
                raise RuntimeError(
                    f"register_comm_hook does not support hybrid strategies, but {module_class_name(unit.module)} "
                    f"uses {unit.sharding_strategy.name} (reduce-scatter and all-reduce: no single hook fits)"
                )
            if unit._state.group is not None and unit._state.group.reduce_settings.comm_hook is not None:
                raise RuntimeError("register_comm_hook was already called: a communication hook is registered")
        for unit in units:
            if unit._state.group is not None:
                unit._state.group.reduce_settings.comm_hook = (hook, state)

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
        previous = [g.requires_gradient_sync for g in groups]
        for group in groups:
            group.requires_gradient_sync = False
        try:
            yield
        finally:
            for group, value in zip(groups, previous):
                group.requires_gradient_sync = value

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Iterator[None]:
        """Makes the full parameters of ``module``'s units visible for the block.

        Args:
            module: a wrapper (or any module containing wrappers / fully_shard modules).
            recurse: also every unit below ``module`` (else ``module``'s own only).
            writeback: copy changes back into the shards on exit.
            rank0_only: only rank 0 keeps the full parameters (needs writeback=False).
            offload_to_cpu: hand out CPU copies.
            with_grads: also gather gradients into ``.grad``.
        """
        states = states_below(module) if recurse else [s for s in [get_state(module)] if s is not None]
        _summoned.update(states)
        try:
            with full_params(states, writeback, rank0_only, offload_to_cpu, with_grads):
                yield
        finally:
            _summoned.difference_update(states)

    # -- state dicts (see fullshard.state_dict) ------------------------------------------
    state_dict_type = staticmethod(state_dicts.state_dict_type)
    set_state_dict_type = staticmethod(state_dicts.set_state_dict_type)
    get_state_dict_type = staticmethod(state_dicts.get_state_dict_type)

    @staticmethod
    def optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """``optim``'s state keyed by parameter FQN, full or sharded like the model's
        state dict (see ``fullshard.state_dict.optim_state_dict``). ``optim_state_dict``:
        the index-keyed dict to convert instead of ``optim.state_dict()``."""
        _warn_if_group_given(group, "FSDP.optim_state_dict")
        return state_dicts.optim_state_dict(model, optim, optim_state_dict)

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """The FQN-keyed ``optim_state_dict`` in the form ``optim.load_state_dict`` takes
        (loaded right away with ``load_directly``).

        Raises:
            NotImplementedError: ``is_named_optimizer=True`` (torchrec's NamedOptimizer).
        """
        if is_named_optimizer:
            raise NotImplementedError(
                "FSDP.optim_state_dict_to_load supports torch.optim optimizers, not NamedOptimizer: "
                "pass is_named_optimizer=False"
            )
        _warn_if_group_given(group, "FSDP.optim_state_dict_to_load")
        result = state_dicts.optim_state_dict_to_load(model, optim, optim_state_dict)
        if load_directly:
            optim.load_state_dict(result)
        return result

    # -- FSDP1's older optimizer-state calls, as compositions of the two above -----------------
    @staticmethod
    def full_optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_input: OptimInput = None,
        rank0_only: bool = True,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """``optim_state_dict`` under FULL_STATE_DICT (CPU tensors; ``{}`` off rank 0
        with ``rank0_only``), whatever the model's state-dict type. A collective.

        ``optim_input`` is deprecated (a FutureWarning, as in PyTorch): ``optim`` lists its parameters.
        """
        _param_groups(optim, optim_input, "FSDP.full_optim_state_dict")
        _warn_if_group_given(group, "FSDP.full_optim_state_dict")
        config = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only)
        with state_dicts.state_dict_type(model, StateDictType.FULL_STATE_DICT, optim_state_dict_config=config):
            return state_dicts.optim_state_dict(model, optim)

    @staticmethod
    def sharded_optim_state_dict(
        model: nn.Module, optim: torch.optim.Optimizer, group: dist.ProcessGroup | None = None
    ) -> dict[str, Any]:
        """``optim_state_dict`` under SHARDED_STATE_DICT: states as DTensor shards,
        whatever the model's state-dict type (load with ``optim_state_dict_to_load``)."""
        _warn_if_group_given(group, "FSDP.sharded_optim_state_dict")
        with state_dicts.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            return state_dicts.optim_state_dict(model, optim)

    @staticmethod
    def shard_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any],
        model: nn.Module,
        optim_input: OptimInput = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """This rank's part of an FQN-keyed optimizer state dict, keyed by index for
        ``optim.load_state_dict``. Without ``optim``, the optimizer's parameters are
        ``optim_input`` (its parameters or param groups), else ``model.parameters()``.
        Accepts sharded dicts too (any layout); no communication.

        Raises:
            ValueError: ``full_optim_state_dict`` is keyed by index (rekey it to PARAM_NAME first).
        """
        keys = [
            *full_optim_state_dict["state"],
            *(k for g in full_optim_state_dict["param_groups"] for k in g["params"]),
        ]
        if not all(isinstance(key, str) for key in keys):
            raise ValueError(
                "shard_full_optim_state_dict expects an optimizer state dict keyed by parameter name: convert it "
                "with FSDP.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, model) first"
            )
        groups = _param_groups(optim, optim_input, "FSDP.shard_full_optim_state_dict")
        return state_dicts.optim_state_dict_for_params(model, groups, full_optim_state_dict)

    @staticmethod
    def scatter_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any] | None,
        model: nn.Module,
        optim_input: OptimInput = None,
        optim: torch.optim.Optimizer | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """``shard_full_optim_state_dict`` of the dict given on ``group``'s first rank
        (the other ranks may pass None): it is broadcast over ``group`` (default: all
        ranks), so only one rank needs to load the checkpoint. A collective."""
        source = dist.get_global_rank(group, 0) if group is not None else 0
        mine: dict[str, Any] = {}  # a placeholder off the source rank
        if dist.get_rank() == source:
            if full_optim_state_dict is None:
                raise ValueError(f"scatter_full_optim_state_dict expects the state dict on rank {source} but got None")
            # On the CPU: unpickled tensors would otherwise land on the source's device.
            mine = map_tensors(torch.Tensor.cpu, full_optim_state_dict)
        received = comm.broadcast_object(mine, src_rank=source, group=group)
        return FullyShardedDataParallel.shard_full_optim_state_dict(received, model, optim_input, optim)

    @staticmethod
    def flatten_sharded_optim_state_dict(
        sharded_optim_state_dict: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """``sharded_optim_state_dict``'s output in the form ``optim.load_state_dict``
        takes: ``optim_state_dict_to_load`` (which reads any layout)."""
        return FullyShardedDataParallel.optim_state_dict_to_load(model, optim, sharded_optim_state_dict)

    @staticmethod
    def rekey_optim_state_dict(
        optim_state_dict: dict[str, Any],
        optim_state_key_type: OptimStateKeyType,
        model: nn.Module,
        optim_input: OptimInput = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """``optim_state_dict`` keyed by parameter name or by index (``optim_state_dict``
        itself when already so): to load a wrapped model's full dict into an
        unwrapped model's optimizer, or the reverse. Indices follow ``optim``'s
        parameters, else ``optim_input``'s, else ``model.parameters()``; param
        groups list their keys sorted.

        Raises:
            RuntimeError: a flat parameter in the optimizer (``use_orig_params=False``:
                its state is no single parameter's), as FSDP1.
            ValueError: a key ``model`` lacks, or an unknown ``optim_state_key_type``.
        """
        # By name: torch's own OptimStateKeyType members work too.
        name = getattr(optim_state_key_type, "name", None)
        if name not in OptimStateKeyType.__members__:
            raise ValueError(f"rekey_optim_state_dict expects an OptimStateKeyType but got {optim_state_key_type!r}")
        groups = _param_groups(optim, optim_input, "FSDP.rekey_optim_state_dict")
        by_name = name == OptimStateKeyType.PARAM_NAME.name
        return state_dicts.rekey_optim_state_dict(optim_state_dict, by_name, model, groups)

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
_summoned: weakref.WeakSet[ModuleState] = weakref.WeakSet()  # units inside summon_full_params


OptimInput = list[dict[str, Any]] | Iterable[nn.Parameter] | None


def _param_groups(
    optim: torch.optim.Optimizer | None, optim_input: OptimInput, caller: str
) -> list[list[torch.Tensor]] | None:
    """The optimizer's parameters per group: ``optim``'s, else ``optim_input``'s (its
    constructor argument: parameters or param-group dicts), else None."""
    if optim_input is not None:
        warnings.warn(
            f"{caller}: the optim_input argument is deprecated (as in PyTorch's FSDP); pass optim instead, "
            "or neither to use the model's parameters",
            FutureWarning,
            stacklevel=3,
        )
    if optim is not None:
        return [list(group["params"]) for group in optim.param_groups]
    if optim_input is None:
        return None
    items: list[Any] = list(optim_input)
    if items and isinstance(items[0], dict):
        return [list(group["params"]) for group in items]
    return [items]


def _warn_if_group_given(group: dist.ProcessGroup | None, caller: str) -> None:
    if group is not None:
        warnings.warn(
            f"{caller} ignores group: every unit communicates over its own process group", UserWarning, stacklevel=3
        )


def _check_not_wrapped_differently(module: nn.Module, strategy: ShardingStrategy) -> None:
    if isinstance(module, FullyShardedDataParallel) and module.sharding_strategy is not strategy:
        raise ValueError(
            f"FullyShardedDataParallel expects a module not already wrapped with another strategy, but "
            f"{module_class_name(module.module)} is wrapped with {module.sharding_strategy.name} and "
            f"{strategy.name} was requested; wrap the unwrapped module once"
        )


def _no_shard_on_one_rank(strategy: ShardingStrategy, mesh_info: MeshInfo) -> tuple[ShardingStrategy, MeshInfo]:
    """FULL_SHARD and SHARD_GRAD_OP over one rank are NO_SHARD (FSDP1 switches, and warns)."""
    if strategy in HYBRID_STRATEGIES or strategy is ShardingStrategy.NO_SHARD or mesh_info.shard.size != 1:
        return strategy, mesh_info
    warnings.warn(
        f"FullyShardedDataParallel switches from {strategy} to ShardingStrategy.NO_SHARD: the "
        "process group has one rank, so there is nothing to shard",
        UserWarning,
        stacklevel=3,
    )
    return ShardingStrategy.NO_SHARD, MeshInfo.for_replicate(mesh_info.mesh)


def _warn_if_mixed_requires_grad(params: list, owner: str) -> None:
    """Frozen and trainable parameters in one unit: the unit reduces a gradient buffer covering the
    frozen ones too (FSDP1 warns the same)."""
    if len({p.sharded_param.requires_grad for p in params}) > 1:
        warnings.warn(
            f"{owner} has both parameters with requires_grad=True and False: the unit's gradient memory and "
            "communication cover the frozen parameters too; wrap the frozen modules in their own unit to avoid it",
            UserWarning,
            stacklevel=4,
        )


def _check_one_use_orig_params(module: nn.Module, use_orig_params: bool) -> None:
    """Wrappers under one root share use_orig_params: the optimizer and the
    state dicts see either flat or original parameters, not a mix."""
    for nested in module.modules():
        state = get_state(nested) if isinstance(nested, FullyShardedDataParallel) else None
        if state is not None and state.config.flat_param == use_orig_params:
            raise ValueError(
                f"FullyShardedDataParallel expects one use_orig_params for all wrappers, but "
                f"{module_class_name(module)} gets use_orig_params={use_orig_params} and its nested wrapper "
                f"of {module_class_name(nested)} has use_orig_params={not use_orig_params}"
            )


def _resolve_ignored(
    module: nn.Module,
    ignored_modules: Iterable[nn.Module] | None,
    ignored_states: Iterable[nn.Parameter | nn.Module] | None,
) -> tuple[set[nn.Module], set[nn.Parameter]]:
    """The ignored modules (with their subtrees) and parameters below ``module``.

    Entries elsewhere are skipped: one list may be given to several wrappers,
    each taking what lies below it (as FSDP1 does).
    """
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            "FullyShardedDataParallel expects ignored_modules or ignored_states, not both; pass all "
            "of them as ignored_states"
        )
    items = list(ignored_modules or ignored_states or ())
    kinds = {nn.Module if isinstance(item, nn.Module) else nn.Parameter for item in items}
    if len(kinds) > 1:
        raise ValueError(
            "FullyShardedDataParallel expects ignored_states to be all parameters or all modules, but got "
            f"{sorted(type(item).__name__ for item in items)}; ignore the modules' parameters instead"
        )
    for item in items:
        if not isinstance(item, (nn.Module, nn.Parameter)):
            raise ValueError(
                f"FullyShardedDataParallel expects ignored states to be modules or parameters but got "
                f"{type(item).__name__}"
            )
        if isinstance(item, FullyShardedDataParallel):
            raise ValueError(
                f"FullyShardedDataParallel expects ignored modules that are not wrapped, but "
                f"{module_class_name(item)} is a FullyShardedDataParallel; ignore the module it wraps "
                "before wrapping it instead"
            )
    if any(item is module for item in items):
        raise ValueError(
            f"FullyShardedDataParallel expects the wrapped module itself not to be ignored "
            f"({module_class_name(module)}); ignore its submodules instead"
        )
    own = set(module.modules())
    expanded = {m for ignored in items if isinstance(ignored, nn.Module) and ignored in own for m in ignored.modules()}
    own_params = set(module.parameters())
    params = {p for p in items if isinstance(p, nn.Parameter) and p in own_params}
    params |= {p for m in expanded for p in m.parameters()}
    return expanded, params


def _device_type(device_id: int | torch.device | None) -> str:
    if device_id is None:
        return default_device_type()
    if isinstance(device_id, int):
        torch.cuda.set_device(device_id)
        return "cuda"
    device = torch.device(device_id)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return device.type


def _resolve_mesh(
    process_group: Any,
    device_mesh: DeviceMesh | None,
    strategy: ShardingStrategy,
    policy: Any,
    device_id: int | torch.device | None,
) -> MeshInfo:
    """FSDP1's rules for which groups a unit shards and replicates over."""
    if process_group is not None and device_mesh is not None:
        raise ValueError(
            "Cannot pass both process_group and device_mesh at the same time. Please just pass only one of them."
        )
    device_type = _device_type(device_id)
    if strategy in HYBRID_STRATEGIES:
        if device_mesh is not None:
            if device_mesh.ndim != 2:
                raise ValueError(f"Expected device_mesh to have ndim=2 but got {device_mesh.ndim}")
            return MeshInfo.for_fully_shard(device_mesh)
        if process_group is None:
            if policy is None:
                raise ValueError(
                    f"Manual wrapping with {strategy} requires explicit specification of process group or device_mesh."
                )
            return MeshInfo.for_fully_shard(hybrid_mesh(device_type))
        if not (
            isinstance(process_group, tuple)
            and len(process_group) == 2
            and all(isinstance(g, dist.ProcessGroup) for g in process_group)
        ):
            raise ValueError(
                "Expected process_group to be passed in as either None or "
                f"Tuple[dist.ProcessGroup, dist.ProcessGroup] but got {type(process_group)}"
            )
        shard_group, replicate_group = process_group
        return MeshInfo.for_fully_shard(mesh_from_groups(shard_group, replicate_group, device_type))
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise ValueError(
                f"{strategy.name} expects a 1D device_mesh but got {describe_mesh(device_mesh)}; "
                "2D meshes are for the hybrid strategies"
            )
        mesh = device_mesh
    elif process_group is not None:
        if isinstance(process_group, tuple):
            raise ValueError(
                f"{strategy.name} expects one process group; a (shard, replicate) pair is for the hybrid strategies"
            )
        mesh = mesh_from_groups(process_group, None, device_type)
    else:
        mesh = default_mesh(device_type, "FullyShardedDataParallel")
    return MeshInfo.for_replicate(mesh) if strategy is ShardingStrategy.NO_SHARD else MeshInfo.for_fully_shard(mesh)


@dataclass(frozen=True, kw_only=True)
class _Settings:
    """A wrapper's constructor arguments that the wrappers its policy creates inherit
    (as FSDP1's do); the groups only where an override asks for its own."""

    process_group: dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup] | None
    device_mesh: DeviceMesh | None
    cpu_offload: CPUOffload | None
    backward_prefetch: BackwardPrefetch | None
    mixed_precision: MixedPrecision | None
    param_init_fn: Callable[[nn.Module], None] | None
    device_id: int | torch.device | None
    sync_module_states: bool
    forward_prefetch: bool
    limit_all_gathers: bool
    use_orig_params: bool

    def inherited(self) -> dict[str, Any]:
        """The constructor keywords a policy's wrapper gets (it shares the groups through its mesh)."""
        skipped = ("process_group", "device_mesh")
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skipped}


def _unit_config(strategy: ShardingStrategy, settings: _Settings) -> UnitConfig:
    precision = settings.mixed_precision or MixedPrecision()
    offload = settings.cpu_offload
    reshard = {
        ShardingStrategy.FULL_SHARD: None,  # resharded after forward, except the root
        ShardingStrategy.HYBRID_SHARD: None,
        ShardingStrategy.SHARD_GRAD_OP: False,
        ShardingStrategy._HYBRID_SHARD_ZERO2: False,
        ShardingStrategy.NO_SHARD: False,
    }[strategy]
    return UnitConfig(
        api_name="FullyShardedDataParallel",
        ignore_argument="ignored_states",
        name_in_model=model_name,
        reshard_after_forward=reshard,
        mp_policy=MixedPrecisionPolicy(
            param_dtype=precision.param_dtype,
            reduce_dtype=precision.reduce_dtype,
            cast_forward_inputs=precision.cast_forward_inputs,
        ),
        offload_policy=CPUOffloadPolicy() if offload is not None and offload.offload_params else OffloadPolicy(),
        forward_prefetch=settings.forward_prefetch,
        backward_prefetch=settings.backward_prefetch,
        cast_root_inputs=precision.cast_root_forward_inputs and precision.param_dtype is not None,
        keep_low_precision_grads=precision.keep_low_precision_grads,
        # Read when wrapping, as PyTorch's FSDP1 does.
        full_precision_in_eval=os.environ.get("FSDP_USE_FULL_PREC_IN_EVAL", "") == "1",
        buffer_dtype=precision.buffer_dtype,
        flat_param=not settings.use_orig_params,
        presentation=LocalViews(flatten=strategy is not ShardingStrategy.NO_SHARD)
        if settings.use_orig_params
        else None,
        sync_module_states=settings.sync_module_states,
    )


def _wrap_selected(
    module: nn.Module,
    policy: Policy | PolicyFn,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    strategy: ShardingStrategy,
    mesh_info: MeshInfo,
    settings: _Settings,
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
            child_mesh = _resolve_mesh(
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
        }
        wrapper = FullyShardedDataParallel(child, **kwargs)
        for parent, name in parents.get(id(child), []):
            setattr(parent, name, wrapper)


def _materialize_meta(
    module: nn.Module, param_init_fn: Callable[[nn.Module], None] | None, device: torch.device, ignored: set[nn.Module]
) -> None:
    """FSDP1: meta-device modules are initialized when wrapped.

    ``param_init_fn`` (or ``to_empty`` + ``reset_parameters``) is applied to each
    module the wrapper manages, parents before children (breadth first, as FSDP1
    does, so seeded random initialisation gives FSDP1's values); nested
    wrappers were initialized by their own constructor.
    """
    managed = _breadth_first(get_managed_modules(module, ignored), module)
    tensors = [t for m in managed for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))]
    if not any(t.is_meta for t in tensors):
        return
    if param_init_fn is not None and not callable(param_init_fn):
        raise ValueError(f"FullyShardedDataParallel expects a callable param_init_fn but got {param_init_fn!r}")
    with torch.no_grad():
        for submodule in managed:
            if param_init_fn is not None:
                param_init_fn(submodule)
                continue
            if not any(True for _ in (*submodule.parameters(recurse=False), *submodule.buffers(recurse=False))):
                continue
            reset = getattr(submodule, "reset_parameters", None)
            if not callable(reset):
                raise ValueError(
                    f"FullyShardedDataParallel expects meta-device modules to define reset_parameters(), but "
                    f"{module_class_name(submodule)} does not; give it one or pass param_init_fn"
                )
            submodule.to_empty(device=device, recurse=False)
            reset()


def _breadth_first(modules: list[nn.Module], root: nn.Module) -> list[nn.Module]:
    """``modules`` (a subtree of ``root``) in breadth-first order."""
    wanted, frontier = set(modules), [root]
    order: list[nn.Module] = []
    seen = {root}
    while frontier:
        order.extend(m for m in frontier if m in wanted)
        children = [c for m in frontier for c in m.children() if c in wanted and c not in seen]
        seen.update(children)
        frontier = list(dict.fromkeys(children))
    return order


def _adopt_user_params(wrapper: nn.Module, _args: Any) -> None:
    """Parameters the user replaced or re-pointed since the last step become the shards, for every unit
    this forward may gather (the root's forward prefetches its children). See ``adopt_user_params``."""
    state = get_state(wrapper)
    if state is None or state.is_root is False:
        return
    for below in states_below(wrapper):
        if below.group is not None:
            adopt_user_params(below.group)
