"""The engine's entry point: put one module's parameters under one unit.

Both front ends (``fully_shard``, ``replicate``, and the FSDP1-style wrapper)
end here with one resolved ``MeshInfo`` and a ``UnitConfig``; nothing below
knows which front end called. Here too: what a ``fully_shard`` call manages
(modules, parameters, the meta device), the checks on its arguments, and the
check of optimizers built before sharding.

[Note: Optimizer built before sharding]
Sharding registers new parameter objects (the shards, as DTensors or flat
pieces); the originals leave the model. An optimizer built from
``model.parameters()`` before that holds the originals: their ``.grad`` stays
None, so its ``step()`` changes nothing, silently (torch's FSDP behaves the
same). The originals that sharding replaced are remembered weakly, by identity;
the first ``step()`` of every optimizer, through one global step pre-hook
registered at the first replacement, checks its parameters against them once
and warns. Later steps cost one weak-set lookup.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from ..api import CPUOffloadPolicy
from . import comm
from .comm import GroupInfo
from .gather import ParamModuleInfo, ShardParam, UnitSpec, is_tensor_subclass
from .layout import ROW_SHARDS, ShardLayout, flat_shards
from .mesh import MeshInfo, post_forward_group, validate_mesh_backend
from .presentation import DTENSOR_SHARDS
from .settings import UnitConfig, UnitSettings
from .step import ModuleState, get_state, module_class_name
from .trace import ROOT
from .unit import ParamGroup


def resolve_reshard_after_forward(
    config: UnitConfig, mesh_info: MeshInfo, module: nn.Module
) -> tuple[bool, GroupInfo | None]:
    """(reshard after forward?, smaller post-forward group for an int)."""
    value, api = config.reshard_after_forward, config.api_name
    if value is None:
        return True, None
    if isinstance(value, bool):
        return value, None
    shard_size = mesh_info.shard.size
    if not isinstance(value, int):
        raise ValueError(
            f"{api} expects reshard_after_forward to be None, a bool or an int but got "
            f"{value!r} ({type(value).__name__}) for {module_class_name(module)}"
        )
    if value < 1 or shard_size % value != 0:
        raise ValueError(
            f"{api} expects reshard_after_forward to be a bool or an int that divides the "
            f"shard size {shard_size}, but got {value} for {module_class_name(module)}"
        )
    if value == 1:
        return False, None  # keeping 1/1 of the parameters is not resharding
    if value == shard_size:
        return True, None
    return True, post_forward_group(mesh_info, value)


def manage_module(
    module: nn.Module | tuple[nn.Module, ...],
    mesh_info: MeshInfo,
    config: UnitConfig,
    ignored_params: Iterable[nn.Parameter] | None = None,
    ignored_modules: Iterable[nn.Module] = (),
) -> ModuleState:
    """Shards the parameters of ``module`` (or of several modules, one unit over
    all of them) minus those of already-managed submodules."""
    roots = (module,) if isinstance(module, nn.Module) else root_modules(module)
    device = mesh_info.device
    validate_mesh_backend(mesh_info, module_class_name(roots[0]), config.api_name)
    # Entries outside the module are not an error: one ignore list may serve
    # several units, each taking what lies below it.
    ignored = set(ignored_params or ())
    reshard, post_forward = resolve_reshard_after_forward(config, mesh_info, roots[0])
    modules = get_managed_modules(roots, ignored_modules)
    params, buffers = get_managed_states(modules, ignored)
    infos = get_param_module_infos(params, roots)
    names = {id(p): config.name_in_model(name) for root in roots for name, p in root.named_parameters()}
    owner = (
        "[" + ", ".join(module_class_name(m) for m in roots) + "]" if len(roots) > 1 else module_class_name(roots[0])
    )
    validate_params(params, infos, names, owner, config)
    validate_devices(roots, params, config.api_name)
    if config.sync_module_states:
        broadcast_from_first_rank(params, buffers, mesh_info)
    buffer_dtypes = move_buffers(modules, device, config.buffer_dtype)
    mp_policy = config.mp_policy
    dims = shard_dims(params, config.shard_placement_fn, names, config.api_name)
    if post_forward is not None and any(dims):
        raise NotImplementedError(
            f"{config.api_name} does not support an int reshard_after_forward with shard_placement_fn's "
            f"non-zero shard dims yet ({module_class_name(roots[0])}); pass a bool"
        )
    shard_layout = choose_shard_layout(params, dims, mesh_info, config.flat_layout)
    presentation = config.presentation or DTENSOR_SHARDS
    shard_params = [
        ShardParam(
            p,
            info,
            mesh_info,
            mp_policy.param_dtype,
            presentation,
            dim,
            names.get(id(p)),
            shard_layout.pieces_of(i),
            config.api_name,
        )
        for i, (p, info, dim) in enumerate(zip(params, infos, dims))
    ]
    for shard_param, param in zip(shard_params, params):
        shard_param.fqn = names.get(id(param), shard_param.fqn)  # root-relative after lazy init
    # See [Note: Optimizer built before sharding].
    replaced = [(p, sp.fqn) for sp, p in zip(shard_params, params) if sp.sharded_param is not p]
    remember_replaced(replaced, config.api_name)
    claim_params(params, infos, owner, config.api_name)
    if not shard_params:
        return ModuleState(roots, None, config, device, buffer_dtypes)
    spec = unit_spec(shard_params, mesh_info, config, owner, shard_layout)
    extended = [p.fqn for p in shard_params if p.extension is not None]
    if extended and (post_forward is not None or spec.offload):
        raise NotImplementedError(
            f"{'CPU offload' if spec.offload else 'an int reshard_after_forward'} is not yet supported with "
            f"tensor-subclass parameters ({extended[0]} in {owner})"
        )
    chosen = config.reshard_after_forward is not None
    group = ParamGroup(spec, UnitSettings(reshard, post_forward, reshard_after_forward_chosen=chosen))
    return ModuleState(roots, group, config, device, buffer_dtypes)


def choose_shard_layout(
    params: list[nn.Parameter], dims: list[int], mesh_info: MeshInfo, flat_layout: bool
) -> ShardLayout:
    """How the unit's parameters are cut into shards, before their ``ShardParam``s exist: FSDP1's
    flat parameter when the front end asks for it (see [Note: Flat layout]) and one flat tensor
    can hold them, else rows. Several dtypes, frozen next to trainable, tensor subclasses,
    tensor-parallel DTensors (a piece of a local tensor is no DTensor) and other shard dims keep
    their rows: the front end's flat parameter is then the rows buffer, and trains as before the
    flat layout (issue 35)."""
    if (
        not flat_layout
        or len({p.dtype for p in params}) > 1
        or len({p.requires_grad for p in params}) > 1
        or any(isinstance(p, DTensor) or is_tensor_subclass(p.detach()) for p in params)
        or any(dims)
    ):
        return ROW_SHARDS
    return flat_shards([p.numel() for p in params], mesh_info.shard.size)


def unit_spec(
    params: list[ShardParam], mesh_info: MeshInfo, config: UnitConfig, name: str, shard_layout: ShardLayout = ROW_SHARDS
) -> UnitSpec:
    """The spec of the unit over ``params`` (see [Note: Unit spec])."""
    device, policy = mesh_info.device, config.offload_policy
    offload = isinstance(policy, CPUOffloadPolicy)
    return UnitSpec(
        params=params,
        mesh_info=mesh_info,
        device=device,
        offload=offload,
        storage_device=torch.device("cpu") if offload else device,
        pin_memory=isinstance(policy, CPUOffloadPolicy) and policy.pin_memory and device.type != "cpu",
        mp_policy=config.mp_policy,
        presentation=config.presentation or DTENSOR_SHARDS,
        keep_low_precision_grads=config.keep_low_precision_grads,
        shard_layout=shard_layout,
        name=name,
        label=ROOT,
    )


def states_below(module: nn.Module) -> list[ModuleState]:
    """The engine states of ``module`` and every module below it, in module order
    (a unit over several modules appears once)."""
    found = [s for s in (get_state(m) for m in module.modules()) if s is not None]
    return list(dict.fromkeys(found))


# Set on an original parameter once a unit shards it: a parameter shared by
# two units would otherwise be silently duplicated (and untied).
_CLAIM_ATTR = "_fullshard_sharded_by"
# Where a unit's parameters are registered: module -> {parameter name: the unit}. The
# module then holds the unit's own forms (DTensors, replaced by .to() or .half()),
# which a later call must not take for tensor-parallel parameters and shard again.
_REGISTERED: weakref.WeakKeyDictionary[nn.Module, dict[str, str]] = weakref.WeakKeyDictionary()


def root_modules(modules: Iterable[nn.Module]) -> tuple[nn.Module, ...]:
    """``modules`` minus those inside another one's subtree (one unit over several modules)."""
    modules = tuple(dict.fromkeys(modules))
    inside = {d for m in modules for d in m.modules() if d is not m}
    return tuple(m for m in modules if m not in inside)


def get_managed_modules(
    roots: nn.Module | tuple[nn.Module, ...], ignored_modules: Iterable[nn.Module] = ()
) -> list[nn.Module]:
    """The subtrees of ``roots`` minus subtrees that another call already manages.

    Each module appears once even if it is registered at several places.
    """
    roots = (roots,) if isinstance(roots, nn.Module) else roots
    ignored = set(ignored_modules)
    managed: list[nn.Module] = []
    visited: set[nn.Module] = set()
    stack = list(reversed(roots))
    while stack:
        module = stack.pop()
        if module in visited or module in ignored:
            continue
        visited.add(module)
        if module not in roots and get_state(module) is not None:
            continue
        managed.append(module)
        stack.extend(reversed(list(module.children())))
    return managed


def get_managed_states(
    modules: list[nn.Module], ignored_params: set[nn.Parameter] | None = None
) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    """The parameters and buffers registered directly on ``modules``, deduplicated."""
    ignored = ignored_params or set()
    params: list[nn.Parameter] = []
    buffers: list[torch.Tensor] = []
    seen: set[int] = set()
    for module in modules:
        for param in module.parameters(recurse=False):
            if id(param) not in seen and param not in ignored:
                seen.add(id(param))
                params.append(param)
        for buffer in module.buffers(recurse=False):
            if id(buffer) not in seen:
                seen.add(id(buffer))
                buffers.append(buffer)
    return params, buffers


def get_param_module_infos(params: list[nn.Parameter], roots: tuple[nn.Module, ...]) -> list[ParamModuleInfo]:
    """For each parameter, the module registering it first and every other registration.

    Traverses with duplicates: a module registered twice shows up as sharing
    its parameters with itself, which is harmless when swapping and honest.
    """
    wanted = {id(p) for p in params}
    infos: dict[int, ParamModuleInfo] = {}
    for _, module in (item for root in roots for item in root.named_modules(remove_duplicate=False)):
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            if id(param) not in wanted:
                continue
            info = infos.get(id(param))
            if info is None:
                infos[id(param)] = ParamModuleInfo(module, name)
            else:
                info.shared_modules.append(module)
                info.shared_param_names.append(name)
    missing = [p for p in params if id(p) not in infos]
    if missing:
        raise AssertionError(
            f"{len(missing)} managed parameters are not in the module tree of {module_class_name(roots[0])}"
        )
    return [infos[id(p)] for p in params]


def validate_module(module: nn.Module, api: str) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{api} expects an nn.Module but got {module_class_name(module)}")
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward:
        # Forward hooks on a container that is never called would never run.
        raise ValueError(
            f"{api} expects a module with a forward but got a {module_class_name(module)}, which has none; "
            f"apply {api} to each of its modules, or pass them as a list to make one unit"
        )
    if get_state(module) is not None:
        raise ValueError(
            f"{api} expects a module that fully_shard/replicate has not been applied to, but "
            f"{module_class_name(module)} already has; apply it once per module"
        )
    reject_torch_fsdp(module, api)


# torch's own FSDP, recognised by its classes' names in torch's tree without importing them (the
# clean-room line in DESIGN.md): FSDP2's swapped-in classes (and composable replicate's) derive
# from its FSDPModule, FSDP1's wrapper is its FullyShardedDataParallel.
_TORCH_FSDP_CLASSES = ("FSDPModule", "FullyShardedDataParallel")


def _torch_fsdp_class(module: nn.Module) -> type | None:
    for cls in type(module).__mro__:
        if cls.__name__ in _TORCH_FSDP_CLASSES and cls.__module__.startswith("torch."):
            return cls
    return None


def reject_torch_fsdp(module: nn.Module, api: str) -> None:
    """Raises ValueError when torch's FSDP already manages ``module`` or a module below it: its
    parameters are torch's DTensors and its hooks torch's, which no fullshard unit can take over."""
    for name, sub in module.named_modules():
        cls = _torch_fsdp_class(sub)
        if cls is not None:
            # torch's FSDP2 swaps in a class derived from the user's: name the user's
            user = next(c for c in type(sub).__mro__ if not issubclass(c, cls))
            where = f"{user.__name__} ({name})" if name else user.__name__
            raise ValueError(
                f"{api} expects modules that torch's FSDP has not been applied to, but {where} is already "
                f"sharded by torch's FSDP ({type(sub).__module__}.{type(sub).__name__}): use fullshard's {api} on "
                "every module (import it from fullshard, not from torch), or torch's on every one"
            )


def shard_dims(
    params: list[nn.Parameter],
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
    names: dict[int, str],
    api: str,
) -> list[int]:
    """Each parameter's shard dim from ``shard_placement_fn`` (None: dim 0)."""
    if shard_placement_fn is None:
        return [0] * len(params)
    dims = []
    for param in params:
        placement = shard_placement_fn(param)
        name = names.get(id(param), "?")
        if placement is None:
            dims.append(0)
            continue
        if type(placement) is not Shard:
            raise ValueError(
                f"{api} expects shard_placement_fn to return Shard(dim) or None but got {placement!r} for {name}"
            )
        dim = placement.dim + param.ndim if placement.dim < 0 else placement.dim
        if not 0 <= dim < param.ndim:
            raise ValueError(
                f"{api} expects shard_placement_fn to return a dim of {name}'s {param.ndim}D shape "
                f"{tuple(param.shape)} but got Shard({placement.dim})"
            )
        dims.append(dim)
    return dims


def validate_devices(roots: tuple[nn.Module, ...], params: list[nn.Parameter], api: str) -> None:
    """All managed parameters on one device (all on meta counts as one)."""

    def where(p: torch.Tensor) -> torch.device:
        return p._local_tensor.device if isinstance(p, DTensor) else p.device

    if len({where(p) for p in params}) > 1:
        names = {id(p): n for root in roots for n, p in root.named_parameters(remove_duplicate=False)}
        listing = ", ".join(f"{names.get(id(p), '?')} on {where(p)}" for p in params)
        raise ValueError(
            f"{api} expects all parameters of {module_class_name(roots[0])} on one device but got: "
            f"{listing}. Move the module to one device (or build it all on meta) first."
        )


def validate_dtensor_meshes(module: nn.Module, mesh_device_type: str) -> None:
    """Tensor-parallel parameters must live on the same kind of device as the FSDP mesh."""
    for param in module.parameters():
        if isinstance(param, DTensor) and param.device_mesh.device_type != mesh_device_type:
            raise ValueError(
                "Requires DTensor to have mesh of the same type as the FSDP mesh but got "
                f"{param.device_mesh.device_type} for DTensor and {mesh_device_type} for FSDP"
            )


def move_buffers(
    modules: list[nn.Module], device: torch.device, dtype: torch.dtype | None = None
) -> dict[int, torch.dtype]:
    """Moves managed buffers to ``device`` (floating ones cast to ``dtype``).

    Shared buffers stay shared. Returns the original dtype of each cast buffer,
    keyed by the id of the new tensor (state dicts report the original dtype).
    """
    moved: dict[int, torch.Tensor] = {}
    original_dtypes: dict[int, torch.dtype] = {}
    for module in modules:
        for name, buffer in list(module._buffers.items()):
            if buffer is None or buffer.is_meta:
                continue
            target = dtype if dtype is not None and buffer.is_floating_point() else buffer.dtype
            if buffer.device == device and buffer.dtype == target:
                continue
            new = moved.get(id(buffer))
            if new is None:
                new = moved[id(buffer)] = buffer.to(device, target)
                if target != buffer.dtype:
                    original_dtypes[id(new)] = buffer.dtype
            module._buffers[name] = new
    return original_dtypes


@torch.no_grad()
def broadcast_from_first_rank(params: list[nn.Parameter], buffers: list[torch.Tensor], mesh_info: MeshInfo) -> None:
    """Every rank of the mesh takes the first rank's parameters and buffers.

    Across the shard group, then across the replicate group: every replica ends
    up with the values of shard rank 0 of replica 0. One broadcast per dtype.
    """
    # A DTensor (tensor parallel; its buffers too) is synced through its local tensor: one rank of
    # each tensor-parallel group per broadcast, as the shard and replicate groups are data parallel.
    tensors = [t._local_tensor if isinstance(t, DTensor) else t.detach() for t in [*params, *buffers]]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        if not tensor.is_meta:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for group in (mesh_info.shard, mesh_info.replicate):
        if group.size == 1 or group.group is None:
            continue
        for same_dtype in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in same_dtype]).to(mesh_info.device)
            comm.broadcast(flat, 0, group.group)
            offset = 0
            for tensor in same_dtype:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()


def validate_params(
    params: list[nn.Parameter], infos: list[ParamModuleInfo], names: dict[int, str], owner: str, config: UnitConfig
) -> None:
    """Rejects parameters no unit can take: 0-dim ones (a shard is a slice of rows),
    and the forms of parameters another unit already shards.

    Raises:
        ValueError: either (naming the parameter and the fix).
    """
    api = config.api_name
    for param, info in zip(params, infos):
        name = names.get(id(param), info.param_name)
        sharded_by = _REGISTERED.get(info.module, {}).get(info.param_name)
        if sharded_by is not None:
            raise ValueError(
                f"{api} expects parameters that no unit shards yet, but {name} of {owner} is already "
                f"sharded by {sharded_by}; apply {api} to submodules "
                f"before their parents (each parameter is sharded once, by the innermost call)"
            )
        if param.ndim == 0:
            raise ValueError(
                f"{api} expects parameters with at least one dimension but got the 0-dim {name} of {owner}; "
                f"reshape it to (1,) or pass it in {config.ignore_argument}"
            )


def claim_params(params: list[nn.Parameter], infos: list[ParamModuleInfo], owner: str, api: str) -> None:
    """Records which call shards each parameter, and where it is registered; a
    second claim is a user error."""
    for param in params:
        previous = getattr(param, _CLAIM_ATTR, None)
        if previous is not None:
            raise ValueError(
                f"{api} expects each parameter to be managed by one unit, but a parameter of "
                f"{owner} is already managed by another ({previous}). Shared (tied) parameters "
                f"must live in one unit: apply {api} to a common parent of the modules sharing it, or "
                f"{api}([module_a, module_b]) to the modules themselves."
            )
    for param, info in zip(params, infos):
        setattr(param, _CLAIM_ATTR, f"{api} on {owner}")
        for module, name in info.owners():
            _REGISTERED.setdefault(module, {})[name] = f"{api} on {owner}"


_replaced: WeakIdKeyDictionary = WeakIdKeyDictionary()  # original parameter -> (its name, the call that sharded it)
_checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_hook: RemovableHandle | None = None


def remember_replaced(pairs: Iterable[tuple[nn.Parameter, str]], api: str) -> None:
    """Records parameters that sharding (the front end ``api``) took out of the model (with their FQNs)."""
    global _hook
    for param, name in pairs:
        _replaced[param] = (name, api)
    if _hook is None and len(_replaced):
        _hook = register_optimizer_step_pre_hook(_check_once)


def _check_once(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _checked:
        return
    _checked.add(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    stale = [_replaced[p] for p in params if p in _replaced]
    if not stale:
        return
    held = "none of the sharded model's" if len(stale) == len(params) else f"{len(params) - len(stale)} others"
    name, api = stale[0]
    warnings.warn(
        f"{type(optimizer).__name__} holds {len(stale)} parameter(s) that {api} replaced "
        f"(e.g. {name}) and {held}: it steps nothing for them. Build the optimizer after sharding, "
        "from the sharded model's parameters()",
        UserWarning,
        stacklevel=3,
    )
