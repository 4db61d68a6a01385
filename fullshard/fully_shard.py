"""The composable front end: ``fully_shard(module)`` and ``FSDPModule``.

Usage (2 ranks on CPU)::

    torchrun --nproc-per-node 2 train.py

    for block in model.blocks:
        fully_shard(block)          # one unit per block: gathered only while it runs
    fully_shard(model)              # the root unit: embeddings, head, the rest
    optim = torch.optim.AdamW(model.parameters())   # DTensor shards

The mesh arguments (``mesh``, ``dp_mesh_dims``, FSDP1's ``strategy``) resolve
here, once, into the one ``MeshInfo`` the engine receives (``resolve_mesh``).

[Note: SPMD meshes]
``DataParallelMeshDims`` names the mesh dims that shard and replicate; several
names flatten into one dim. The engine then runs on that data-parallel mesh: 1D
(shard, or replicate only) or 2D (replicate, shard), as if it had been passed
as ``mesh``. Parameters may be DTensors on the whole mesh, replicated on its
data-parallel dims and placed on the others (tensor parallelism): their shards
stay on that mesh, the data-parallel shard dim becoming Shard(0) (see
``ShardParam._init_whole_mesh``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from typing import Any, NoReturn, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ._core import compat
from ._core.manage import (
    get_managed_modules,
    get_managed_states,
    manage_module,
    root_modules,
    states_below,
    validate_dtensor_meshes,
    validate_module,
)
from ._core.mesh import MeshInfo, default_device_type, default_mesh, describe_mesh, hybrid_mesh
from ._core.settings import UnitConfig
from ._core.step import ModuleState, get_state, module_class_name
from .api import (
    HYBRID_STRATEGIES,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
    StateDictType,
)
from .comm_settings import CommSettings
from .state_dict.model import default_settings, install_state_dict_hooks
from .wrap import Policy, PolicyFn, select_modules

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "share_comm_ctx"]


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the all-gather."""

    def wait(self) -> None:
        """Makes the unsharded parameters usable (nothing left to wait for here)."""


class _UnitUnshardHandle(UnshardHandle):
    def __init__(self, state: ModuleState) -> None:
        self._state: ModuleState | None = state

    def wait(self) -> None:
        if self._state is not None and self._state.group is not None:
            self._state.group.wait_for_unshard()
        self._state = None


class FSDPModule(CommSettings, nn.Module):
    """Mixed into the class of every module that ``fully_shard`` was applied to
    (first base of ``FSDP<Class>(FSDPModule, Class)``; see ``swap_class``)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Containers build new instances of their own class (nn.Sequential
        # slicing): those are plain modules, so build the original class.
        original: type[nn.Module] = cls._fullshard_original_class  # type: ignore[attr-defined]  # swap_class's
        return original(*args, **kwargs)

    def _fsdp_state(self) -> ModuleState:
        state = get_state(self)
        if state is None:  # swap_class runs after manage_module
            raise AssertionError(f"rank {dist.get_rank()}: an FSDPModule without its unit's state")
        return state

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gathers this module's parameters now (e.g. before a custom forward).

        Args:
            async_op: return a handle instead of waiting; call ``wait()`` on it
                before using the parameters.
        """
        state = self._fsdp_state()
        # No lazy init: before the first forward this unit may be nested, and the root's
        # lazy init is to find it not yet claimed (torch's unshard gathers without one too).
        if state.group is not None:
            state.group.unshard(async_op=async_op)
        return _UnitUnshardHandle(state) if async_op else None

    def reshard(self) -> None:
        """Frees this module's full parameters and registers the shards again."""
        group = self._fsdp_state().group
        if group is not None:
            group.reshard()

    def _states(self, recurse: bool) -> list[ModuleState]:
        if recurse:
            return states_below(self)
        return [self._fsdp_state()]

    def _groups(self, recurse: bool) -> Iterable:
        for state in self._states(recurse):
            if state.group is not None:
                yield state.group

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Turns gradient reduction off for accumulation steps (on for the last one).

        While off, gradients accumulate unsharded (in the reduce dtype); the next
        backward with sync on reduces the sum.
        """
        for group in self._groups(recurse):
            group.settings.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Keeps the full parameters after backward (saves the next forward's all-gather).

        The optimizer updates the shards: call ``reshard()`` (or set this back to
        True for the last micro-batch) before stepping.
        """
        for group in self._groups(recurse):
            group.settings.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Changes ``reshard_after_forward`` at run time, e.g. False for the root
        (its default) set to True to save memory, or False for evaluation.

        A bool replaces an int given to ``fully_shard``: True reshards fully.
        """
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(
                f"set_reshard_after_forward expects a bool but got {type(reshard_after_forward).__name__} "
                f"for {type(self).__name__}; an int (a smaller post-forward group) can only be given to fully_shard"
            )
        for group in self._groups(recurse):
            group.set_reshard_after_forward(reshard_after_forward)  # also kept through lazy init

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP gradient accumulation with the reduce-scatter but not the all-reduce.

        While False, each backward reduce-scatters and keeps the result; the next
        backward with True adds the kept results in before its all-reduce, so
        replicas communicate once per accumulation. Set it back to True for the
        last micro-batch. No effect without a replicate dimension.
        """
        for group in self._groups(recurse):
            group.settings.reduce.all_reduce = requires_all_reduce

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Reduced gradients become the sum over all data-parallel ranks divided by
        ``factor`` (default: averaged, i.e. divided by the number of ranks).
        For example 1.0 sums, for a loss that is already normalised globally."""
        if not factor > 0:
            raise ValueError(
                f"set_gradient_divide_factor expects a positive factor but got {factor} for {type(self).__name__}"
            )
        for group in self._groups(recurse=False):
            group.settings.reduce.divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """The older name of ``set_gradient_divide_factor``."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor",
            FutureWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduces with SUM only, dividing before and after in separate steps,
        never with AVG: for backends or transports that handle only sums
        (e.g. NCCL's zero-copy collectives). The same result up to rounding."""
        for group in self._groups(recurse=False):
            group.settings.reduce.sum_only = enable

    def reset_iter_state(self) -> None:
        """Forgets a step that an exception cut short in forward or backward (an
        out-of-memory error caught to skip a batch, say): waits for the collectives in
        flight, drops that step's reductions and gradients (accumulated ones too),
        reshards every unit and lets the next step start afresh. Call it on the root
        after catching the exception; the root's next forward also does it by itself,
        with a warning."""
        self._fsdp_state().reset_iter_state("reset_iter_state")

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Reduces zero gradients for the trainable parameters this rank's backward
        did not reach, as DDP's ``find_unused_parameters`` does: every rank then
        reduces the same parameters when ranks use different ones (a mixture of
        experts routing by data). Without it such a unit's ranks would reduce
        different parameter sets together. A unit that some ranks skip entirely
        reduces at the end of their backward: keep conditionally used parameters
        in a unit every rank runs (e.g. the whole expert layer)."""
        for group in self._groups(recurse):
            group.settings.reduce.include_unused = reduce_scatter_unused_params

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Calls ``hook(reduced)`` with this unit's reduced gradient shards (one flat
        tensor, the unit's parameters back to back) after its last collective
        (the reduce-scatter; with HSDP the all-reduce), before they reach
        ``.grad``: for an extra reduction of one's own, e.g. across a group
        fullshard does not know. In-place changes are kept."""
        if stream is not None:
            raise NotImplementedError(
                f"set_all_reduce_hook runs the hook where {type(self).__name__}'s reduction finishes; "
                "a separate stream is not supported: pass stream=None"
            )
        for group in self._groups(recurse=False):
            group.settings.reduce.post_reduce_hook = hook

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the step's last (default True). Only the last
        one waits for every gradient reduction at its end; with False (earlier
        micro-batches) reductions stay in flight and finish during later
        backwards, so ``.grad`` is complete only after a last backward. Applies
        to every unit under the root until set again."""
        self._fsdp_state().ctx.is_last_backward = is_last_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False skips this unit's all-gather in backward: for units whose backward
        reads no parameter values (an embedding's gradient needs only its
        indices). A backward that does read them then fails or is wrong."""
        for group in self._groups(recurse=False):
            group.settings.unshard_in_backward = unshard_in_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gathers ``modules`` as soon as this module's forward starts (replaces implicit prefetch)."""
        self._fsdp_state().forward_prefetch = _states_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gathers ``modules`` as soon as this module's backward starts (replaces implicit prefetch)."""
        self._fsdp_state().backward_prefetch = _states_of(modules, "set_modules_to_backward_prefetch")

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        result = super()._apply(*args, **kwargs)
        group = self._fsdp_state().group
        if group is not None:
            group.repack_after_apply()
        return result

    def __deepcopy__(self, memo: dict) -> NoReturn:
        raise NotImplementedError(
            "fully_shard modules cannot be deep-copied (their parameters are shards tied to "
            "hooks); deep-copy the model before applying fully_shard, or use its state_dict"
        )


def _states_of(modules: list[Any], api: str) -> list[ModuleState]:
    states = []
    for module in modules:
        state = get_state(module) if isinstance(module, nn.Module) else None
        if state is None:
            raise ValueError(
                f"{api} expects modules that fully_shard was applied to, but got {module_class_name(module)}"
            )
        states.append(state)
    return states


_SWAPPED_CLASSES: dict[tuple[type, type], type] = {}


def swap_class(module: nn.Module, mixin: type, prefix: str) -> None:
    """Makes ``module`` an instance of ``<prefix><Class>(mixin, Class)``."""
    cls = type(module)
    key = (cls, mixin)
    new_cls = _SWAPPED_CLASSES.get(key)
    if new_cls is None:
        new_cls = _SWAPPED_CLASSES[key] = type(
            f"{prefix}{cls.__name__}", (mixin, cls), {"_fullshard_original_class": cls}
        )
    module.__class__ = new_cls


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
    policy: Policy | PolicyFn | None = None,
    strategy: ShardingStrategy | None = None,
    ignored_modules: Iterable[nn.Module] | None = None,
) -> FSDPModule:
    """Shards ``module``'s parameters across ``mesh`` as one communication unit.

    Call it on submodules first (each becomes its own unit), then on the root,
    or let ``policy`` pick the submodules. Parameters already managed by a call
    on a submodule are left to it.

    Args:
        module: the module to shard (changed in place and returned), or a list
            of modules that become one unit (gathered once for all of them, e.g.
            embeddings, final norm and output head): the pass starts at the
            first of them to run forward and ends after the last.
        mesh: 1D mesh (FSDP) or 2D ``(replicate, shard)`` mesh (HSDP). Default:
            all ranks, on the current accelerator if there is one, else CPU.
        reshard_after_forward: True frees the full parameters after forward
            (re-gathered in backward); False keeps them; an int ``k`` keeps
            1/k of them so backward re-gathers within groups of ``k`` ranks;
            None: True, except for the root (the first module to run forward).
        shard_placement_fn: ``fn(param)`` returns ``Shard(dim)`` to shard that
            parameter on ``dim`` (e.g. experts on dim 1), or None for dim 0.
            Sizes need not divide evenly. Not with tensor-parallel parameters
            or an int ``reshard_after_forward``.
        mp_policy: parameter/reduction/output dtypes (``MixedPrecisionPolicy``).
        offload_policy: ``CPUOffloadPolicy()`` keeps shards and gradients on CPU.
        ignored_params: parameters left alone (not sharded, moved or reduced).
        dp_mesh_dims: ``mesh`` is a whole SPMD mesh and these are its
            data-parallel dims (``DataParallelMeshDims``): the unit shards over
            ``shard`` and replicates over ``replicate`` (several names are
            flattened into one dim). Not with ``strategy`` or an int
            ``reshard_after_forward``.
        policy: an auto-wrap policy (``fullshard.wrap``): the submodules it
            selects get their own ``fully_shard`` first, with these arguments.
        strategy: a ``ShardingStrategy`` instead of ``mesh``/``reshard_after_forward``:
            SHARD_GRAD_OP keeps parameters after forward, NO_SHARD replicates,
            the hybrid ones shard within a node and replicate across nodes.
        ignored_modules: submodules left alone, with everything below them.

    Returns:
        ``module`` (each of them, for a list), whose class now also derives from
        ``FSDPModule``.

    Raises:
        ValueError: the module is already managed (by fullshard, or by torch's FSDP
            anywhere below it) or is a container without
            forward (``nn.ModuleList``), the mesh is not 1D/2D (or does not suit
            ``strategy``), parameters sit on different devices,
            ``reshard_after_forward`` is neither a bool nor an int dividing the
            shard size, ``shard_placement_fn`` returns something other than
            ``Shard(dim)``/None, or ``module`` itself is in ``ignored_modules``.
            Ignored parameters/modules outside ``module`` are skipped.
    """
    listed = list(module) if isinstance(module, (list, tuple)) else [module]
    for candidate in listed:
        validate_module(candidate, "fully_shard")
    roots = root_modules(listed)
    requested_reshard = reshard_after_forward  # what the policy's units get, to resolve for themselves
    mesh_info, reshard_after_forward = resolve_mesh(roots, mesh, dp_mesh_dims, strategy, reshard_after_forward)
    ignored = set().union(*(_expand_ignored_modules(root, ignored_modules) for root in roots))
    ignored_params = set(ignored_params or ()) | {p for m in ignored for p in m.parameters()}
    if policy is not None:
        arguments = dict(
            # With dp_mesh_dims the units below resolve the same whole mesh and dims as this one (the
            # resolved data-parallel mesh alone would shard a replicate-only choice over its replicas).
            mesh=mesh if dp_mesh_dims is not None else mesh_info.mesh,
            dp_mesh_dims=dp_mesh_dims,
            reshard_after_forward=requested_reshard,
            mp_policy=mp_policy,
            shard_placement_fn=shard_placement_fn,
            offload_policy=offload_policy,
            strategy=strategy,
        )
        for child, overrides in (item for root in roots for item in select_modules(root, policy, ignored)):
            below = set(child.modules())
            fully_shard(
                child,
                **{**arguments, **overrides},
                ignored_params={p for p in ignored_params if any(p is q for q in child.parameters())},
                ignored_modules=[m for m in ignored if m in below],
            )
    config = UnitConfig(
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        shard_placement_fn=shard_placement_fn,
    )
    state = manage_module(roots, mesh_info, config, ignored_params, ignored)
    install_state_dict_hooks(state, default_settings(StateDictType.SHARDED_STATE_DICT))
    for root in roots:
        swap_class(root, FSDPModule, "FSDP")
    return cast(FSDPModule, module)  # swap_class made it one (a list: each of its modules)


def resolve_mesh(
    roots: tuple[nn.Module, ...],
    mesh: DeviceMesh | None,
    dp_mesh_dims: DataParallelMeshDims | None,
    strategy: ShardingStrategy | None,
    reshard_after_forward: bool | int | None,
) -> tuple[MeshInfo, bool | int | None]:
    """The ``MeshInfo`` a ``fully_shard`` call's unit runs on, and its resolved
    ``reshard_after_forward`` (a strategy decides it); every mesh check is made here."""
    if dp_mesh_dims is not None:
        mesh, replicate_only = resolve_dp_mesh_dims(roots, mesh, dp_mesh_dims, strategy, reshard_after_forward)
    else:
        mesh, replicate_only, reshard_after_forward = _resolve_strategy(roots[0], mesh, strategy, reshard_after_forward)
    for root in roots:
        validate_dtensor_meshes(root, mesh.device_type)
    mesh_info = MeshInfo.for_replicate(mesh) if replicate_only else MeshInfo.for_fully_shard(mesh)
    return mesh_info, reshard_after_forward


def _resolve_strategy(
    module: nn.Module,
    mesh: DeviceMesh | None,
    strategy: ShardingStrategy | None,
    reshard_after_forward: bool | int | None,
) -> tuple[DeviceMesh, bool, bool | int | None]:
    """Maps an FSDP1 strategy onto (mesh, replicate only?, resharding choice)."""
    if strategy is None:
        mesh = mesh if mesh is not None else default_mesh(None, "fully_shard")
        validate_mesh(mesh)
        return mesh, False, reshard_after_forward
    keeps = strategy in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2)
    if reshard_after_forward is not None and strategy is ShardingStrategy.NO_SHARD:
        raise ValueError(
            f"fully_shard expects no reshard_after_forward with NO_SHARD (parameters are never sharded) but got "
            f"reshard_after_forward={reshard_after_forward} for {module_class_name(module)}"
        )
    if reshard_after_forward is not None and keeps == bool(reshard_after_forward):
        raise ValueError(
            f"fully_shard expects either strategy or reshard_after_forward, but got {strategy.name} with "
            f"reshard_after_forward={reshard_after_forward} for {module_class_name(module)}"
        )
    reshard = False if keeps else reshard_after_forward
    if strategy in HYBRID_STRATEGIES:
        mesh = mesh if mesh is not None else hybrid_mesh(default_device_type())
        if mesh.ndim != 2:
            raise ValueError(f"fully_shard expects a 2D DeviceMesh for {strategy.name} but got {describe_mesh(mesh)}")
        return mesh, False, reshard
    mesh = mesh if mesh is not None else default_mesh(None, "fully_shard")
    if mesh.ndim != 1:
        raise ValueError(f"fully_shard expects a 1D DeviceMesh for {strategy.name} but got {describe_mesh(mesh)}")
    if strategy is ShardingStrategy.NO_SHARD:
        return mesh, True, False
    return mesh, False, reshard


def resolve_dp_mesh_dims(
    roots: tuple[nn.Module, ...],
    mesh: DeviceMesh | None,
    dims: DataParallelMeshDims,
    strategy: ShardingStrategy | None,
    reshard_after_forward: bool | int | None,
) -> tuple[DeviceMesh, bool]:
    """``fully_shard``'s (data-parallel mesh, replicate only?) for ``dp_mesh_dims``."""
    owner = module_class_name(roots[0])
    if strategy is not None:
        raise ValueError(f"fully_shard expects either strategy or dp_mesh_dims, but got both for {owner}")
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"fully_shard does not support an int reshard_after_forward with dp_mesh_dims yet ({owner}); pass a bool"
        )
    mesh = mesh if mesh is not None else default_mesh(None, "fully_shard")
    names = {id(p): name for root in roots for name, p in root.named_parameters()}
    params, _ = get_managed_states(get_managed_modules(roots))  # not those of units below
    return data_parallel_mesh(mesh, dims, [(names[id(p)], p) for p in params])


def data_parallel_mesh(
    mesh: DeviceMesh, dims: DataParallelMeshDims, params: Iterable[tuple[str, nn.Parameter]]
) -> tuple[DeviceMesh, bool]:
    """(the data-parallel mesh, replicate only?) for ``mesh`` and ``dims``.

    Raises:
        ValueError: the mesh has no dim names, a name is not among them, a
            parameter is a plain tensor while a non-data-parallel dim has more
            than one rank (it would need to be a DTensor on the whole mesh), or
            a DTensor parameter is on another mesh or not Replicate() on the
            data-parallel dims.
        NotImplementedError: DTensor parameters with several shard (or
            replicate) dims, which would flatten into one.
    """
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("fully_shard expects a mesh with mesh_dim_names when dp_mesh_dims is given, but got none")
    for name in (*dims.shard_names, *dims.replicate_names):
        if name not in names:
            raise ValueError(f"fully_shard expects dp_mesh_dims among the mesh's dims {names}, but got {name!r}")
    data_parallel = {*dims.shard_names, *dims.replicate_names}
    others = [name for name in names if name not in data_parallel and mesh[name].size() > 1]
    for name, param in params:
        if isinstance(param, DTensor):
            _check_whole_mesh_param(name, param, mesh, dims)
        elif others:
            raise ValueError(
                f"fully_shard(dp_mesh_dims=...) expects parameters that are DTensors on the whole mesh when its "
                f"non-data-parallel dims {others} have more than one rank, but {name} is a plain tensor"
            )
    shard = _flattened(mesh, dims.shard_names)
    replicate = _flattened(mesh, dims.replicate_names)
    if shard is None and replicate is not None:
        return replicate, True
    if shard is None:
        raise AssertionError("DataParallelMeshDims names neither shard nor replicate dims")
    if replicate is None:
        return shard, False
    return compat.concatenate_meshes([replicate, shard]), False


def _check_whole_mesh_param(name: str, param: DTensor, mesh: DeviceMesh, dims: DataParallelMeshDims) -> None:
    if param.device_mesh != mesh:
        raise ValueError(
            f"fully_shard(dp_mesh_dims=...) expects DTensor parameters on the mesh it is given "
            f"{mesh.mesh_dim_names}, but {name} is on {param.device_mesh}; distribute it on the whole mesh"
        )
    if len(dims.shard_names) > 1 or len(dims.replicate_names) > 1:
        raise NotImplementedError(
            f"fully_shard(dp_mesh_dims=...) does not support DTensor parameters ({name}) with several shard or "
            f"replicate dims yet (got {dims}); name one dim each"
        )
    names = mesh.mesh_dim_names or ()
    for dim in (*dims.shard_names, *dims.replicate_names):
        placement = param.placements[names.index(dim)]
        if not isinstance(placement, Replicate):
            raise ValueError(
                f"fully_shard(dp_mesh_dims=...) expects parameters Replicate() on the data-parallel dim {dim!r}, "
                f"but {name} has {placement}; distribute it with Replicate() there"
            )


def _flattened(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh | None:
    if not names:
        return None
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))


def validate_mesh(mesh: DeviceMesh) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard expects a DeviceMesh for mesh but got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {describe_mesh(mesh)}")


def _expand_ignored_modules(module: nn.Module, ignored_modules: Iterable[nn.Module] | None) -> set[nn.Module]:
    """The ignored modules below ``module``, with their subtrees; entries elsewhere
    are skipped (one list may serve several units, as with ``ignored_params``)."""
    below = set(module.modules())
    ignored = {m for m in ignored_modules or () if m in below}
    if module in ignored:
        raise ValueError(
            f"fully_shard expects ignored_modules to be proper submodules of {module_class_name(module)}, "
            f"but got {module_class_name(module)} itself; leave it unsharded instead"
        )
    return {m for ignored_module in ignored for m in ignored_module.modules()}


fully_shard.state = get_state  # type: ignore[attr-defined]


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Makes ``module.<method_name>`` gather and free parameters like ``forward``.

    For methods such as ``generate`` that do not go through ``__call__``;
    ``forward`` calls made inside the method reuse the gathered parameters.
    """
    state = get_state(module)
    if state is None:
        raise ValueError(
            f"register_fsdp_forward_method expects a module that fully_shard was applied to, "
            f"but got {module_class_name(module)}"
        )
    method = getattr(module, method_name, None)
    if method is None or not callable(method):
        raise ValueError(
            f"register_fsdp_forward_method expects {module_class_name(module)} to have a method {method_name!r}"
        )

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.pre_forward(args, kwargs)
        state.in_registered_method = True
        try:
            output = method(*args, **kwargs)
        finally:
            state.in_registered_method = False
        return state.post_forward(output)

    module.__dict__[method_name] = wrapped


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Lets several roots (pipeline stages' model chunks) share communication
    streams. fullshard's side streams are already one per device and process,
    shared by every root, so this only checks its argument."""
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(
                f"share_comm_ctx expects modules that fully_shard was applied to, but got {module_class_name(module)}"
            )
