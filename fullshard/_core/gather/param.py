"""One original parameter: its shard, its DTensor view, its unsharded form.

[Note: Parameter forms]
- sharded: by default an ``nn.Parameter`` wrapping a ``DTensor`` (``Shard(0)``
  on the shard axis, ``Replicate()`` on the replicate axis, followed by
  tensor-parallel placements if the parameter already was a DTensor); the FSDP1
  wrapper may present it otherwise (see [Note: Presentations]). Either way it is
  a view into the unit's shard buffer, so the optimizer's in-place updates land
  there and the next all-gather sends them without any copy. This is the form
  registered on the module outside forward/backward.
- unsharded: a plain ``nn.Parameter`` (a TP ``DTensor`` for TP parameters)
  created once and kept for the module's lifetime. Only its storage comes and
  goes (``resize_``), so autograd sees one leaf across steps: a module used
  twice in one forward, or activation recomputation, accumulates into the same
  gradient. Registered on the module during forward/backward.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .. import comm, compat
from ..common import set_module_tensor
from ..mesh import MeshInfo
from ..presentation import DTENSOR_SHARDS, DTensorShards
from .extension import GatherExtension, TensorHooks, shard_subclass


@dataclass
class ParamModuleInfo:
    """Where a parameter is registered: its owner and any module sharing it.

    Swapping sharded <-> unsharded parameters must update every registration,
    or a tied weight would silently untie.
    """

    module: nn.Module
    param_name: str
    shared_modules: list[nn.Module] = field(default_factory=list)
    shared_param_names: list[str] = field(default_factory=list)

    def owners(self) -> list[tuple[nn.Module, str]]:
        """Every (module, name) registering the parameter, its owner first."""
        return [(self.module, self.param_name), *zip(self.shared_modules, self.shared_param_names)]


def is_tensor_subclass(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (a parameter's data, detached) is of a type with its own behaviour."""
    return type(tensor) not in (torch.Tensor, nn.Parameter)


def dtensor_of_local(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: torch.Size,
    stride: tuple[int, ...],
) -> DTensor:
    """A DTensor around ``local`` exactly as it is, with no copy and no device move.

    ``DTensor.from_local`` moves a local tensor to the mesh's device type, which
    would put CPU-offloaded shards (host memory under a CUDA mesh) on the GPU
    and make the parameter a copy of its buffer region instead of a view.
    """
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    return compat.dtensor_with_spec(local, spec, requires_grad=False)


def _contiguous_stride(size: torch.Size) -> tuple[int, ...]:
    stride, running = [], 1
    for dim in reversed(size):
        stride.append(running)
        running *= max(dim, 1)
    return tuple(reversed(stride))


class ShardParam:
    """See [Note: Parameter forms] and [Note: Unit buffers] in layout.py."""

    def __init__(
        self,
        param: nn.Parameter,
        module_info: ParamModuleInfo,
        mesh_info: MeshInfo,
        param_dtype: torch.dtype | None,
        presentation: DTensorShards = DTENSOR_SHARDS,
        shard_dim: int = 0,
        fqn: str | None = None,
        pieces: tuple[tuple[int, int], ...] | None = None,
        api: str = "fully_shard",
    ) -> None:
        """``pieces``: this parameter's (start, stop) of its flattened elements on every shard rank
        under FSDP1's flat layout (``ShardLayout.pieces_of``); None: rows on ``shard_dim``. ``api``:
        the front end the user called, which messages name."""
        self.api = api
        self.module_info = module_info
        self._owners = tuple(module_info.owners())  # where it is registered (swapped twice per unit and step)
        self.presentation = presentation
        self.shard_dim = shard_dim  # the tensor dim split across the shard group; see layout.py
        self.mesh_info = mesh_info
        self.fqn = fqn or module_info.param_name  # made root-relative at lazy init
        # What this parameter all-gathers when it is not its shard's elements
        # (see [Note: Gather extensions]); None for the flat buffer's plain path.
        self.extension: GatherExtension | None = None
        self.global_size = param.size()
        self.global_stride = _contiguous_stride(param.size())
        self._requested_param_dtype = param_dtype
        self.full_precision = False  # compute in orig_dtype despite param_dtype (ParamGroup.set_full_precision)
        # The data-parallel dims of a whole-mesh DTensor parameter's mesh, whose gradient
        # placements (Partial) the reduction handles (see _init_whole_mesh).
        self.dp_dims: frozenset[int] = frozenset()
        if isinstance(param, DTensor):
            if is_tensor_subclass(param._local_tensor):
                raise NotImplementedError(
                    f"{api} does not support tensor-subclass parameters with tensor parallelism yet "
                    f"({self.fqn} is a DTensor over {type(param._local_tensor).__name__})"
                )
            if shard_dim != 0:
                raise NotImplementedError(
                    f"{api} does not support shard_placement_fn's Shard({shard_dim}) with tensor "
                    f"parallelism yet ({module_info.param_name} is a DTensor); return None for it"
                )
            local = self._init_tensor_parallel(param)
        else:
            self.tp_mesh: DeviceMesh | None = None
            self.tp_placements: tuple[Placement, ...] = ()
            self.spmd_mesh = mesh_info.mesh
            self.placements = tuple(Shard(shard_dim) if p.is_shard() else p for p in mesh_info.dp_placements)
            local = param.detach()
        self.unsharded_size = local.size()  # the TP-local size for TP parameters
        # Each shard rank's (start, stop) of the flattened elements under FSDP1's flat layout
        # (see [Note: Flat layout] in layout.py); None: rows split as below.
        self.flat_ranges = list(pieces) if pieces is not None else None
        shard = mesh_info.shard
        if self.flat_ranges is not None:  # a piece of the flat parameter: "rows" are then elements
            if is_tensor_subclass(local) or shard_dim != 0:
                raise AssertionError(f"{self.fqn}: a flat piece is a plain parameter's, sharded on dim 0")
            start, stop = self.flat_ranges[shard.rank]
            self.num_rows, self.row_numel = local.numel(), 1
            self.num_valid_rows = self.shard_rows = self.shard_numel = stop - start
            first_row = start
        else:
            # "Rows" are the slices along the shard dim (dim 0 unless shard_placement_fn says otherwise).
            self.num_rows = local.size(shard_dim)
            self.row_numel = local.numel() // max(self.num_rows, 1)
            self.shard_rows = -(-self.num_rows // shard.size)  # ceil; padded rows per rank
            self.shard_numel = self.shard_rows * self.row_numel
            first_row = shard.rank * self.shard_rows
            self.num_valid_rows = max(0, min(self.shard_rows, self.num_rows - first_row))
        self.orig_dtype = param.dtype
        self._local_size: tuple[int, ...] | None = None  # this rank's unpadded rows' size (cached: every gradient)
        # (spec, dtype): the sharded parameter's DTensor spec, found to serve gradients of that dtype
        # (``present_gradient``); reused while the parameter keeps that spec object.
        self._gradient_spec: tuple[DTensorSpec, torch.dtype] | None = None
        if is_tensor_subclass(local):
            # This rank's rows, for good: a subclass shard stays out of the flat buffer.
            self.bound_rows = self._init_extension(local)
        elif self.flat_ranges is not None:
            self.bound_rows = local.reshape(-1)[first_row : first_row + self.num_valid_rows]
        else:
            # This rank's rows: until the unit packs them into its buffer (``bind_shard``) a view of
            # the unsharded value (keeping its storage alive until then), after it their region of
            # the shard buffer, which the unit gathers and a sharded state dict saves.
            self.bound_rows = local.narrow(shard_dim, min(first_row, self.num_rows), self.num_valid_rows)
        # The user's own object is rebound by bind_shard, so that a later parameter's
        # error leaves the model untouched. A DTensor (tensor parallel) cannot hold a plain
        # view: a new plain Parameter stands for it, as in FSDP1; so for a flat piece, which
        # stands for no object of the user's (the flat parameter replaces them all).
        self.sharded_param = (
            param
            if presentation.keeps_user_param and not isinstance(param, DTensor) and self.flat_ranges is None
            else nn.Parameter(self.present(self.bound_rows), requires_grad=param.requires_grad)
        )
        self._grad_while_full: torch.Tensor | None = None  # the shard's grad while show_full
        self.unsharded_param: nn.Parameter | None = None
        # 1D, unsharded_numel; its storage is freed and re-allocated, the tensor kept.
        self.padded_unsharded: torch.Tensor | None = None
        self._unsharded_storage: torch.UntypedStorage | None = None  # padded_unsharded's (cached: every reshard)
        # False under the wrapper's flat parameter: the module then shows the
        # shard as a plain attribute, and parameters() yields the flat one.
        self.register_sharded = True
        self.aliases_shard = False  # the unsharded form shares the shard's storage
        self._hooked = False  # the unsharded parameter has our post-accumulate hook
        # Gradient summed over steps without sync, in the reduce dtype (1D or ND).
        self.unsynced_grad: torch.Tensor | None = None
        # Called once autograd accumulated this step's gradient (set by ParamGroup).
        self.on_grad_ready: Callable[[ShardParam], None] | None = None

    def _init_extension(self, local: torch.Tensor) -> torch.Tensor:
        """Shards a tensor-subclass parameter (see [Note: Gather extensions])."""
        if self.shard_dim != 0 or self.presentation.keeps_user_param:
            where = "the FSDP1 wrapper" if self.presentation.keeps_user_param else f"Shard({self.shard_dim})"
            raise NotImplementedError(
                f"tensor-subclass parameters ({self.fqn}: {type(local).__name__}) are not yet supported with "
                f"{where}; use fully_shard with dim-0 sharding"
            )
        shard = self.mesh_info.shard
        rows = shard_subclass(local, shard.size, shard.rank, self.fqn, self.api)
        self.extension = TensorHooks(
            self.fqn, self.module_info.module, self.mesh_info, self.unsharded_size, self.shard_rows, self.api
        )
        return rows

    def adopt_gather_hooks(self) -> None:
        """Gathers through the hooks the local shard was given after sharding (see
        [Note: Gather extensions]): the shard leaves the unit's buffer for storage of its
        own, the tensor object (which may carry the hooks itself) kept."""
        local = self.local_shard
        own = local.clone()
        with torch.no_grad():
            local.set_(own.untyped_storage(), 0, own.size(), own.stride())
        self.bound_rows = local
        self.forget_unsharded()
        self.extension = TensorHooks(
            self.fqn, self.module_info.module, self.mesh_info, self.unsharded_size, self.shard_rows, self.api
        )

    @property
    def buffer_numel(self) -> int:
        """Elements this parameter takes in the unit's shard buffer (none with an extension)."""
        return self.shard_numel if self.extension is None else 0

    def _init_tensor_parallel(self, param: DTensor) -> torch.Tensor:
        spec = param._spec
        dp_mesh, tp_mesh = self.mesh_info.mesh, spec.mesh
        dp_names, names = dp_mesh.mesh_dim_names or (), tp_mesh.mesh_dim_names or ()
        if dp_names and all(n in names and spec.placements[names.index(n)].is_replicate() for n in dp_names):
            return self._init_whole_mesh(param)  # else a 2D "TP" mesh is refused below
        if tp_mesh.ndim != 1:
            raise NotImplementedError(
                f"{self.api} supports 1D tensor-parallel meshes, but "
                f"{self.module_info.param_name} is on a {tp_mesh.ndim}D mesh"
            )
        try:
            self.spmd_mesh = compat.concatenate_meshes([dp_mesh, tp_mesh])
        except Exception as exc:  # noqa: BLE001 - re-raised with the fix
            raise ValueError(
                f"{self.api} expects the data-parallel mesh and the tensor-parallel mesh of "
                f"{self.module_info.param_name} to be named slices of one DeviceMesh, e.g. "
                "init_device_mesh(..., mesh_dim_names=('dp', 'tp'))"
            ) from exc
        self.tp_mesh, self.tp_placements = tp_mesh, tuple(spec.placements)
        shard_placement = _dim0_shard_inside(tp_mesh, self.tp_placements, range(tp_mesh.ndim))
        info = self.mesh_info
        if info.shard_axis is None:
            dp_placements: tuple[Placement, ...] = (Replicate(),)
        elif info.replicate_axis is not None:
            dp_placements = (Replicate(), shard_placement)
        else:
            dp_placements = (shard_placement,)
        self.placements = dp_placements + self.tp_placements
        return param._local_tensor

    def _init_whole_mesh(self, param: DTensor) -> torch.Tensor:
        """A DTensor on the whole SPMD mesh (``dp_mesh_dims``), replicated on the
        data-parallel dims (``fully_shard``'s ``resolve_mesh`` raises for others): the shard keeps that mesh
        and its dims' order, and the data-parallel shard dim splits the local
        tensor's dim 0."""
        spec = param._spec
        mesh, names = spec.mesh, spec.mesh.mesh_dim_names or ()
        dp_names = self.mesh_info.mesh.mesh_dim_names or ()
        self.tp_mesh = self.spmd_mesh = mesh
        self.tp_placements = tuple(spec.placements)
        self.dp_dims = frozenset(names.index(name) for name in dp_names)
        placements = list(self.tp_placements)
        if self.mesh_info.shard_axis is not None:
            index = names.index(dp_names[self.mesh_info.shard_axis])
            placements[index] = _dim0_shard_inside(mesh, placements, range(index + 1, mesh.ndim))
        self.placements = tuple(placements)
        return param._local_tensor

    # -- sharded form -------------------------------------------------------
    def bind_shard(self, padded_shard: torch.Tensor) -> None:
        """Points the sharded parameter at ``padded_shard`` (its region of the buffer)."""
        local = self._unpadded(padded_shard)
        self.orig_dtype = local.dtype
        self.bound_rows = local
        if self.sharded_param.dtype != local.dtype and not self.presentation.keeps_user_param:  # model.half()
            self.sharded_param = nn.Parameter(self.present(local), requires_grad=self.sharded_param.requires_grad)
            self.to_sharded()
            return
        self.presentation.rebind(self.sharded_param, self.present(local))

    @property
    def local_shard(self) -> torch.Tensor:
        """This rank's rows (``num_valid_rows`` x the other dims), a view of the buffer."""
        return self.rows_from_presented(self.sharded_param)

    def present(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows (of the parameter, its gradient or an optimizer state)
        as the user sees them. See [Note: Presentations]."""
        return self.presentation.present(self, rows)

    def present_from_padded(self, padded_shard: torch.Tensor) -> torch.Tensor:
        """``present`` of a padded region laid out like the shard buffer's."""
        return self.present(self._unpadded(padded_shard))

    def present_gradient(self, padded_shard: torch.Tensor) -> torch.Tensor:
        """``present_from_padded`` for a reduced gradient (every parameter and step): once the
        sharded parameter's spec was found to serve, the DTensor is built around it directly,
        without the presentation's checks (see ``dtensor_from_rows``)."""
        local = self._unpadded(padded_shard)
        known = self._gradient_spec
        if known is not None and known[1] is local.dtype and getattr(self.sharded_param, "_spec", None) is known[0]:
            return compat.dtensor_with_spec(local, known[0], requires_grad=False)
        presented = self.present(local)
        spec = getattr(self.sharded_param, "_spec", None)
        if isinstance(presented, DTensor) and spec is not None and presented._spec is spec:
            self._gradient_spec = (spec, local.dtype)
        return presented

    def rows_from_presented(self, presented: torch.Tensor) -> torch.Tensor:
        """The rows behind a presented tensor (the inverse of ``present``)."""
        return self.presentation.rows_from_presented(self, presented)

    def show_full(self, value: torch.Tensor, grad: torch.Tensor | None, with_grads: bool) -> None:
        """Registers the full ``value`` (``summon_full_params``): the sharded
        parameter object itself when the presentation keeps it, else a new one (also for a
        tensor-parallel parameter, whose full value is a DTensor: its plain shard cannot hold it)."""
        if not self._keeps_object_when_full:
            full = nn.Parameter(self.full_from_tp_local(value), requires_grad=self.sharded_param.requires_grad)
            full.grad = self.full_from_tp_local(grad) if grad is not None else None
            self._register(full)
            return
        param = self.sharded_param
        self._grad_while_full = param.grad
        if with_grads:
            param.grad = None  # its shape is the shard's
        param.data = value
        if with_grads:
            param.grad = grad

    def full_shown(self) -> torch.Tensor:
        """The full value registered by ``show_full`` (edited or replaced by the user)."""
        registered = self.module_registration()
        if registered is None:
            raise AssertionError(f"{self.fqn} was unregistered while summoned")
        shown = registered.detach()
        return shown._local_tensor if isinstance(shown, DTensor) else shown

    def end_show_full(self) -> None:
        """Registers the sharded form again after ``show_full``."""
        if self._keeps_object_when_full:
            param = self.sharded_param
            param.grad = None
            param.data = self.present(self.bound_rows)
            param.grad = self._grad_while_full
            self._grad_while_full = None
        self.to_sharded()

    @property
    def _keeps_object_when_full(self) -> bool:
        return self.presentation.keeps_user_param and self.tp_mesh is None

    def shard_as_dtensor(self) -> DTensor:
        """The sharded parameter as a DTensor (for state dicts), sharing its storage."""
        return self.dtensor_from_rows(self.local_shard.detach())

    @property
    def local_dtype(self) -> torch.dtype:
        """The shard's dtype (the original dtype, or what ``.to(dtype)`` made it)."""
        return self.sharded_param.dtype

    def _unpadded(self, padded_shard: torch.Tensor) -> torch.Tensor:
        size = self._local_size
        if size is None:
            size = self._local_size = tuple(self.chunk_size(self.num_valid_rows))
        numel = self.num_valid_rows * self.row_numel
        # view(*ints): a torch.Size argument costs as much again as the view itself
        return (padded_shard if padded_shard.numel() == numel else padded_shard.narrow(0, 0, numel)).view(*size)

    def chunk_size(self, num_rows: int) -> torch.Size:
        """The size of ``num_rows`` rows along the shard dim."""
        if self.flat_ranges is not None:
            return torch.Size([num_rows])
        size = list(self.unsharded_size)
        size[self.shard_dim] = num_rows
        return torch.Size(size)

    def full_from_padded(self, padded: torch.Tensor) -> torch.Tensor:
        """The unsharded value inside its padded flat storage (1D, W * shard_numel)."""
        return padded[: self.num_rows * self.row_numel].view(self.unsharded_size)

    def split_views(self, padded: torch.Tensor) -> list[torch.Tensor] | None:
        """Each rank's rows inside padded flat unsharded storage, for a shard dim
        other than 0 (None for dim 0, whose rows are the storage's rank blocks)."""
        return self.rows_per_rank(self.full_from_padded(padded)) if self.shard_dim != 0 else None

    def rows_per_rank(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Each shard rank's rows of ``full`` (the unsharded, TP-local value): views,
        empty for ranks that hold only padding."""
        if self.flat_ranges is not None:
            flat = full.reshape(-1)
            return [flat[start:stop] for start, stop in self.flat_ranges]
        world, rows = self.mesh_info.shard.size, self.shard_rows
        return [
            full.narrow(self.shard_dim, min(r * rows, self.num_rows), max(0, min(rows, self.num_rows - r * rows)))
            for r in range(world)
        ]

    def dtensor_from_rows(self, local: torch.Tensor) -> DTensor:
        """A DTensor like the sharded parameter around an (unpadded) local tensor."""
        sharded = getattr(self, "sharded_param", None)  # None while __init__ builds it
        if isinstance(sharded, DTensor) and sharded.dtype == local.dtype and sharded.shape == self.global_size:
            # Its spec serves as it is (a gradient, every step): building one costs more than the rest.
            spec = sharded._spec
            if spec.mesh is self.spmd_mesh or compat.same_groups(spec.mesh, self.spmd_mesh):
                return compat.dtensor_with_spec(local, spec, requires_grad=False)
        return dtensor_of_local(local, self.spmd_mesh, self.placements, self.global_size, self.global_stride)

    def shard_from_full(self, value: torch.Tensor) -> DTensor:
        """``value`` (the full parameter, or a DTensor of any layout) as this
        parameter's shard: a DTensor laid out like the sharded parameter. Only
        this rank's rows are copied, straight to the device the shard lives on
        (host memory under CPU offload): the full value never visits the
        accelerator."""
        if isinstance(value, DTensor):
            if value.device_mesh == self.spmd_mesh and tuple(value.placements) == tuple(self.placements):
                return value
            value = comm.full_tensor(value)
        if tuple(value.shape) != tuple(self.global_size):
            raise ValueError(f"loading {self.fqn} expects shape {tuple(self.global_size)} but got {tuple(value.shape)}")
        if self.tp_mesh is not None:  # the TP-local value first, as the unsharded parameter holds it
            value = compat.local_region(value, self.tp_mesh, self.tp_placements)
        shard = self.mesh_info.shard
        if self.extension is not None:  # split as the subclass splits, as at sharding (not dequantized)
            local = value.to(self.local_shard.device)
            return self.dtensor_from_rows(shard_subclass(local, shard.size, shard.rank, self.fqn, self.api))
        rows = self.rows_per_rank(value)[shard.rank]
        device = value.device if self.local_shard.is_meta else self.local_shard.device
        local = torch.empty(rows.shape, dtype=rows.dtype, device=device)
        local.copy_(rows)
        return self.dtensor_from_rows(local)

    def module_registration(self) -> nn.Parameter | None:
        info = self.module_info
        return info.module._parameters.get(info.param_name)

    # -- unsharded form -----------------------------------------------------
    @property
    def param_dtype(self) -> torch.dtype:
        return self.orig_dtype if self.full_precision else (self._requested_param_dtype or self.orig_dtype)

    def unsharded_storage(self, device: torch.device) -> torch.Tensor:
        """The unsharded parameter's padded flat storage, allocated (1D)."""
        numel = self.unsharded_numel
        padded = self.padded_unsharded
        if padded is None or self.aliases_shard or padded.device != device or padded.dtype != self.param_dtype:
            # Made outside inference mode even when first gathered inside it: training
            # steps later use the same storage and parameter (and read its versions).
            with torch.inference_mode(False):
                padded = torch.empty(numel, dtype=self.param_dtype, device=device)
            self._set_padded_unsharded(padded)
            self.unsharded_param = None
            self.aliases_shard = False
        elif self._unsharded_storage is not None and self._unsharded_storage.nbytes() == 0:
            self._unsharded_storage.resize_(numel * padded.element_size())
        if self.unsharded_param is None:
            with torch.inference_mode(False):
                self._make_unsharded_param(padded)
        return padded

    @property
    def unsharded_numel(self) -> int:
        """Elements of the unsharded storage: W padded chunks, or a flat piece's whole parameter."""
        if self.flat_ranges is not None:
            return self.num_rows
        return self.mesh_info.shard.size * self.shard_numel

    def alias_unsharded(self, shard_region: torch.Tensor) -> None:
        """For a shard group of one: the unsharded parameter IS the shard (no copy)."""
        padded = self.padded_unsharded
        if not self.aliases_shard or padded is None or padded.data_ptr() != shard_region.data_ptr():
            self._set_padded_unsharded(shard_region)
            self.aliases_shard = True
            self._make_unsharded_param(shard_region)

    def _set_padded_unsharded(self, padded: torch.Tensor | None) -> None:
        self.padded_unsharded = padded
        self._unsharded_storage = None if padded is None else padded.untyped_storage()

    def _make_unsharded_param(self, padded: torch.Tensor) -> None:
        data = self.full_from_tp_local(self.full_from_padded(padded))
        self.unsharded_param = nn.Parameter(data, requires_grad=self.sharded_param.requires_grad)
        self._hooked = False

    def _grad_accumulated(self, unsharded: torch.Tensor) -> None:
        if self.on_grad_ready is not None:
            self.on_grad_ready(self)

    def rebuild_unsharded(self) -> None:
        """Builds (first time) or refreshes the unsharded parameter from what its
        extension gathered (see [Note: Gather extensions])."""
        if self.extension is None:
            raise AssertionError(f"{self.fqn} has no gather extension to rebuild from")
        built = self.extension.rebuild(self.param_dtype, self.unsharded_param)
        if built is not None:
            data = torch.as_strided(built, self.unsharded_size, self.global_stride, 0)
            self.unsharded_param = nn.Parameter(data, requires_grad=self.sharded_param.requires_grad)
            self._hooked = False

    def unsharded_data_assigned(self) -> bool:
        """Whether the user gave the gathered parameter's ``.data`` a tensor of its own (not the
        gathered storage): its values cannot be written back into the shard."""
        unsharded, padded = self.unsharded_param, self.padded_unsharded
        if unsharded is None or padded is None or self.extension is not None or isinstance(unsharded, DTensor):
            return False
        return unsharded.untyped_storage().data_ptr() != padded.untyped_storage().data_ptr()

    def free_unsharded(self) -> None:
        if self.extension is not None:
            self.extension.free()
            return
        storage = self._unsharded_storage
        if storage is not None and storage.nbytes() != 0:
            storage.resize_(0)

    def forget_unsharded(self) -> None:
        """Drops the unsharded form (after a device or dtype change)."""
        self._set_padded_unsharded(None)
        self.unsharded_param = None
        self.aliases_shard = False

    # -- registration on modules ----------------------------------------------
    def full_from_tp_local(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (a full, TP-local tensor) as the user sees the full parameter."""
        if self.tp_mesh is None:
            return value
        return DTensor.from_local(
            value,
            self.tp_mesh,
            self.tp_placements,
            run_check=False,
            shape=self.global_size,
            stride=self.global_stride,
        )

    def _register(self, param: nn.Parameter) -> None:
        """Registers ``param`` on every owner, past ``nn.Module.__setattr__``'s checks where the
        module keeps it (microseconds a call; every parameter is swapped four times a step)."""
        for module, name in self._owners:
            if type(module).__setattr__ is nn.Module.__setattr__:
                attributes = module.__dict__
                if name in attributes:
                    del attributes[name]  # a plain-attribute view from set_module_tensor
                module._parameters[name] = param
            else:
                setattr(module, name, param)

    def to_sharded(self) -> None:
        if self.register_sharded:
            self._register(self.sharded_param)
            return
        view = self.sharded_param.detach()
        for module, name in self._owners:
            set_module_tensor(module, name, view)

    def to_unsharded(self) -> None:
        unsharded = self.unsharded_param
        if unsharded is None:
            raise AssertionError(f"{self.fqn} is registered unsharded before it was gathered")
        if unsharded.requires_grad != self.sharded_param.requires_grad:
            unsharded.requires_grad_(self.sharded_param.requires_grad)
        if unsharded.requires_grad and not self._hooked:
            # Registered lazily: a frozen parameter may be unfrozen later.
            unsharded.register_post_accumulate_grad_hook(_weak_hook(self._grad_accumulated))
            self._hooked = True
        if self.register_sharded:
            self._register(unsharded)
            return
        # Under a flat parameter, a plain attribute as the shard is: parameters() keeps yielding the flat
        # one between forward and backward (as FSDP1's), only summon_full_params registers full ones.
        for module, name in self._owners:
            set_module_tensor(module, name, unsharded)

    def __repr__(self) -> str:
        return f"ShardParam({self.fqn}, size={tuple(self.global_size)})"


def _dim0_shard_inside(mesh: DeviceMesh, placements: Sequence[Placement], dims: Iterable[int]) -> Placement:
    """Our dim-0 shard of a tensor-parallel parameter: the mesh ``dims`` whose ``placements`` shard
    dim 0 cut it first (TP's own dims, or the whole mesh's later dims), so our chunks live inside
    each of theirs, which DTensor spells ``_StridedShard``. One function for both TP layouts."""
    split = math.prod(mesh.size(d) for d in dims if placements[d].is_shard(0))
    return compat.StridedShard(0, split_factor=split) if split > 1 else Shard(0)


def _weak_hook(method: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """``method`` as a tensor hook that does not keep its object alive: the garbage
    collector does not see through a tensor's hook dict, so a hook holding the object
    that holds the tensor would keep both (and the whole model) forever."""
    weak = weakref.WeakMethod(method)

    def hook(tensor: torch.Tensor) -> None:
        bound = weak()
        if bound is not None:
            bound(tensor)

    return hook
