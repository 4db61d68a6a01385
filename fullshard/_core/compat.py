"""Every difference between the torch versions fullshard supports, in one place.

pyproject declares the range (``torch>=2.8,<2.15``); ``make check-torch`` runs
the engine's tests on both ends. A torch name that differs between supported
versions (renamed collectives, DTensor and DeviceMesh internals, newer tensor
attributes) is reached through a helper here, and nothing outside this module
looks at ``torch.__version__``: each helper detects the feature, not the
version. The private names used elsewhere are the same in every supported
version: ``DTensor._local_tensor`` (the local tensor itself, where
``to_local()`` returns an autograd view), ``torch._foreach_copy_``, ``torch._foreach_zero_``,
``torch._amp_foreach_non_finite_check_and_unscale_``, ``torch.utils._pytree``,
``torch._chunk_cat``, ``DTensorSpec`` / ``TensorMeta`` (a DTensor around a local tensor as it is),
``torch.autograd._unsafe_preserve_version_counter``, ``torch._C._current_graph_task_id``
(is backward running: recomputation), ``torch._C._DisableFuncTorch`` (buffer
transitions under ``torch.func.jvp``), ``torch._C._autograd._profiler_enabled``
(profiler labels only while one runs) and ``distributed_c10d._world`` (its ``default_pg``:
``dist.is_initialized()`` without its property chain, before every collective; its
``pg_coalesce_state``: whether a coalescing block is open, see comm.py; looked up at each
call, as torch's thread harness swaps in a per-thread world).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = [
    "ALL_GATHER_INTO_TENSOR",
    "DIRECT_COLLECTIVES",
    "GATHER_OPTIONS",
    "REDUCE_SCATTER_TENSOR",
    "ReduceScatterOptions",
    "StridedShard",
    "backend_device_types",
    "concatenate_meshes",
    "dtensor_with_spec",
    "local_region",
    "set_grad_dtype",
]

# A dim-0 shard nested inside another mesh dimension's dim-0 shard (FSDP + TP).
StridedShard = _StridedShard

# Newer torch names the tensor collectives ``*_single``; older releases only have
# ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (same semantics). Values, not
# wrappers: ``comm.py`` calls them (see [Note: Direct collective calls] there).
ALL_GATHER_INTO_TENSOR = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_TENSOR = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# Whether the process group has the ``*_single`` methods those functions end in, and their
# options: an all-gather's, per async_op flag, built once; a reduce-scatter's class (its op varies).
DIRECT_COLLECTIVES = hasattr(dist.ProcessGroup, "all_gather_single") and hasattr(
    dist.ProcessGroup, "reduce_scatter_single"
)
GATHER_OPTIONS: dict[bool, Any] = {}
ReduceScatterOptions: Any = None
if DIRECT_COLLECTIVES:
    from torch._C._distributed_c10d import AllgatherOptions
    from torch._C._distributed_c10d import ReduceScatterOptions as _ReduceScatterOptions

    ReduceScatterOptions = _ReduceScatterOptions
    for _flag in (False, True):
        GATHER_OPTIONS[_flag] = AllgatherOptions()
        GATHER_OPTIONS[_flag].asyncOp = _flag


def backend_device_types(group: dist.ProcessGroup | None = None) -> list[str]:
    """The device types the group's backend communicates on (``["cuda"]`` for NCCL).

    A mixed backend string (``"cpu:gloo,cuda:nccl"``) lists each device it names.
    """
    backend = str(dist.get_backend(group))
    if ":" in backend:
        return [part.split(":")[0] for part in backend.split(",")]
    return list(dist.Backend.backend_capability.get(backend.lower(), ["cpu"]))


def same_groups(a: DeviceMesh, b: DeviceMesh) -> bool:
    """Whether two meshes run over the same process groups. DeviceMesh equality
    compares only the layout, so torch's sharding-propagation cache can give an
    in-place op's output (an optimizer step on a DTensor parameter) an equal mesh
    of an earlier process group that no longer exists (one process that destroys
    and re-creates its groups)."""
    return a == b and list(a._dim_group_names) == list(b._dim_group_names)


# ``dtensor_with_spec(local, spec, requires_grad=False)``: a DTensor around ``local`` under an
# existing ``spec`` (its dtype ``local``'s). ``DTensor.__new__`` alone: newer torch's
# ``DTensor.__init__`` only enters the base class's, through a dynamo-disabled wrapper that costs
# three times the construction (once per gradient and step on the hot path). A value, not a
# wrapper: no call of ours on that path.
dtensor_with_spec = functools.partial(DTensor.__new__, DTensor)


def local_region(value: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """This rank's piece of the global ``value`` under ``placements`` on ``mesh``,
    as DTensor defines it: a view, nothing copied (``distribute_tensor`` would
    first move all of ``value`` to the mesh's device)."""
    shape, offset = compute_local_shape_and_global_offset(value.shape, mesh, placements)
    for dim, (size, start) in enumerate(zip(shape, offset)):
        value = value.narrow(dim, start, size)
    return value


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh over the dimensions of named slices of a common root mesh (FSDP + TP).

    Raises:
        ValueError: the meshes are not named slices of one root mesh.
    """
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is not None:
        return concatenate(meshes)
    from torch.distributed.device_mesh import _mesh_resources  # older torch: slice the root by names

    root = _mesh_resources.get_root_mesh(meshes[0])
    names = tuple(name for mesh in meshes for name in (mesh.mesh_dim_names or ()))
    if root is meshes[0] or len(names) != sum(mesh.ndim for mesh in meshes):
        raise ValueError("the meshes are not named slices of one DeviceMesh")
    return root[names]


def set_grad_dtype(param: torch.Tensor, dtype: torch.dtype, owner: str) -> None:
    """Lets ``param.grad`` have ``dtype`` instead of the parameter's dtype.

    Raises:
        NotImplementedError: this torch has no ``Tensor.grad_dtype``.
    """
    if not hasattr(torch.Tensor, "grad_dtype"):
        raise NotImplementedError(
            f"keep_low_precision_grads on {owner} needs Tensor.grad_dtype, which this torch "
            f"({torch.__version__}) lacks; upgrade torch or keep gradients in the parameter dtype"
        )
    param.grad_dtype = dtype
