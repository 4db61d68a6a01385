"""Checkpoints on disk through ``torch.distributed.checkpoint``: sharded, atomic, reshardable.

    torchrun --nproc-per-node 4 train.py     # fullshard.checkpoint.save("ckpt", model, optim, extra={"step": 100})
    torchrun --nproc-per-node 2 resume.py    # extra = fullshard.checkpoint.load("ckpt", model, optim)
    python plain.py                          # the same call on an unsharded model, no process group

[Note: Checkpoint layout]
    <path>/LATEST                the name of the newest complete version (one line)
    <path>/<version>/            one DCP checkpoint: .metadata, __<rank>_<n>.distcp
                     manifest.json   format, world size, and each file's size and CRC-32
                     extra.pt        the caller's ``extra`` (written by rank 0)
Every rank writes only its own shards (DCP). A save goes into a new version
folder; only once every rank has finished and the manifest is written does
``LATEST`` move to it, by an atomic ``os.replace``. A crash at any point
before that leaves ``LATEST`` on the previous version, which stays loadable;
the next successful save removes the leftovers.

Checksums cost no extra pass over the data: each file's CRC-32 is computed
while DCP writes it. Loading checks every file's size first (a truncated file
is named at once); the CRC pass, which reads everything again, runs when DCP
fails to load (to name the broken file) or on request (``verify=True``, which
also catches damage that still unpickles).

[Note: Exactly-sized tensors for DCP]
DCP clones every CPU tensor whose storage is larger than the tensor (so that
``torch.save`` does not write the whole storage) and keeps the clones of a
file alive until the file is done. Our shards are views into a unit's flat
buffer, so that would copy every shard. On save we hand DCP aliases over the
same memory whose storage is exactly the tensor (``torch.frombuffer``):
nothing is copied. Loads need no aliases (DCP copies into the views in place)
and are measurably slower with them, so they get the shard views themselves.

The model and optimizer are saved in their sharded form (DTensors keyed by
parameter FQN, or FSDP1's ShardedTensors for a wrapper without a device mesh:
see fullshard.state_dict); DCP reads them back into whatever
layout the loading model has: another world size, another strategy, or a plain
unsharded model in a single process.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
import warnings
import zlib
from collections.abc import Iterator
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.tensor import DTensor

from ._core import comm
from ._core.manage import states_below
from .api import StateDictType
from .state_dict import optim_state_dict, optim_state_dict_to_load, state_dict_type

__all__ = ["CheckpointError", "exists", "load", "read_extra", "save"]

FORMAT_VERSION = 1
LATEST = "LATEST"
MANIFEST = "manifest.json"
EXTRA = "extra.pt"
_CHUNK = 1024 * 1024


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or damaged; the message names the piece."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """Silences DCP's warning that it assumes a single process: without a process group, we mean it."""
    with warnings.catch_warnings():
        if not _distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _is_sharded(model: nn.Module) -> bool:
    return bool(states_below(model))


def _sharded_form(model: nn.Module) -> contextlib.AbstractContextManager:
    if _is_sharded(model):
        return state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
    return contextlib.nullcontext()


def _states(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The model (and optimizer) in their sharded, FQN-keyed form (views, no copies)."""
    with _sharded_form(model):
        states: dict[str, Any] = {"model": model.state_dict()}
        if optimizer is not None:
            states["optim"] = optim_state_dict(model, optimizer)
    return states


def _crc32(path: str) -> int:
    crc, chunk = 0, bytearray(max(1, min(_CHUNK, os.path.getsize(path))))
    view = memoryview(chunk)
    with open(path, "rb", buffering=0) as f:
        while count := f.readinto(view):
            crc = zlib.crc32(view[:count], crc)
    return crc


class _ChecksummedStream:
    """A write stream that keeps the CRC-32 and size of what passes through it."""

    def __init__(self, stream: Any, record: dict[str, int]) -> None:
        self._stream, self._record = stream, record

    def write(self, data: Any) -> int:
        written = self._stream.write(data)
        self._record["crc32"] = zlib.crc32(data, self._record["crc32"])
        self._record["size"] += memoryview(data).nbytes
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _ChecksummingFileSystem(FileSystem):
    """DCP's file system, recording each written file's checksum as it is written."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[str, dict[str, int]] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        try:
            with super().create_stream(path, mode) as stream:
                if "w" not in mode:
                    yield stream
                    return
                record = self.records[os.path.basename(os.fspath(path))] = {"crc32": 0, "size": 0}
                yield _ChecksummedStream(stream, record)
        except OSError as exc:  # a full disk, a quota: name the file (DCP's message does not)
            raise OSError(exc.errno, f"{exc.strerror or exc} (writing {os.fspath(path)})") from exc


def _exactly_sized(tensor: torch.Tensor) -> torch.Tensor:
    """An alias of a contiguous CPU view whose storage is exactly its bytes.
    See [Note: Exactly-sized tensors for DCP]."""
    storage = tensor.untyped_storage()
    if (
        tensor.device.type != "cpu"
        or tensor.numel() == 0
        or storage.nbytes() == tensor.nbytes
        or not tensor.is_contiguous()
    ):
        return tensor
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
    alias = torch.frombuffer(
        whole.numpy().data,  # a memoryview of the storage
        dtype=tensor.dtype,
        count=tensor.numel(),
        offset=int(tensor.storage_offset()) * tensor.element_size(),
    )
    return alias.view(tensor.shape)


def _for_dcp(tree: Any) -> Any:
    """``tree`` with every tensor exactly sized (DTensors and ShardedTensors keep their layout)."""
    if isinstance(tree, DTensor):
        local = _exactly_sized(tree._local_tensor)
        if local is tree._local_tensor:
            return tree
        return DTensor.from_local(
            local, tree.device_mesh, tree.placements, run_check=False, shape=tree.shape, stride=tree.stride()
        )
    if isinstance(tree, ShardedTensor):  # FSDP1's sharded form: its local shards, exactly sized
        shards = [Shard(_exactly_sized(shard.tensor), shard.metadata) for shard in tree.local_shards()]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, tree.metadata(), process_group=tree._process_group
        )
    if isinstance(tree, torch.Tensor):
        return _exactly_sized(tree)
    if isinstance(tree, dict):
        return {key: _for_dcp(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_for_dcp(value) for value in tree]
    return tree


def save(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, extra: Any = None
) -> str:
    """Saves ``model`` (and ``optimizer``, and any picklable ``extra``) under ``path``.

    A collective when distributed: every rank calls it with the same ``path``.

    Returns:
        The version folder written (``path``/<version>).
    """
    path = os.fspath(path)
    version = f"v{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    if _distributed():
        version = comm.broadcast_object(version)
    folder = os.path.join(path, version)
    if _rank() == 0:
        os.makedirs(folder, exist_ok=False)
    if _distributed():
        comm.barrier()
    writer = FileSystemWriter(folder)
    writer.fs = _ChecksummingFileSystem()
    try:
        with _single_process_is_intended():
            dcp.save(_for_dcp(_states(model, optimizer)), storage_writer=writer, no_dist=not _distributed())
    except (Exception, CheckpointException) as exc:  # DCP raises on every rank when one fails
        _failed_save(path, folder, _causes(exc))
    mine = {name: info for name, info in writer.fs.records.items() if name.startswith("__")}
    every = comm.all_gather_objects(mine) if _distributed() else [mine]
    failure = None
    if _rank() == 0:
        try:
            _finish_version(path, version, every, extra)
        except OSError as exc:
            failure = f"rank 0: {type(exc).__name__}: {exc}"
    if _distributed():
        failure = comm.broadcast_object(failure)  # every rank learns whether rank 0 finished
    if failure is not None:
        _failed_save(path, folder, failure)
    return folder


def _finish_version(path: str, version: str, every: list[dict[str, Any]], extra: Any) -> None:
    """Rank 0: the extra object and the manifest, then ``LATEST`` moves to ``version``."""
    folder = os.path.join(path, version)
    if extra is not None:
        torch.save(extra, os.path.join(folder, EXTRA))
    files = {name: info for part in every for name, info in part.items()}
    for name in (".metadata", EXTRA):  # small: read back
        if os.path.exists(os.path.join(folder, name)):
            full = os.path.join(folder, name)
            files[name] = {"size": os.path.getsize(full), "crc32": _crc32(full)}
    manifest = {"format": FORMAT_VERSION, "world_size": len(every), "files": files}
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _point_latest_to(path, version)
    _remove_other_versions(path, keep=version)


def _causes(exc: BaseException) -> str:
    """Each failed rank's exception in one line (DCP's own message is every traceback)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {rank}: {type(error).__name__}: {error}" for rank, (error, _) in failures.items())
    return f"rank {_rank()}: {type(exc).__name__}: {exc}"


def _failed_save(path: str, folder: str, causes: str) -> NoReturn:
    """Every rank: drops the unfinished version (rank 0) and raises; ``LATEST`` never moved."""
    if _distributed():
        comm.barrier()  # no rank still writes into the folder
    if _rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
    previous = "the previous complete one stays what load() finds" if exists(path) else "there is no earlier one"
    raise CheckpointError(f"saving checkpoint {folder} failed ({causes}); the folder was removed and {previous}")


def _point_latest_to(path: str, version: str) -> None:
    """Atomically makes ``version`` the one ``load`` finds."""
    staging = os.path.join(path, f".{LATEST}.{version}")
    with open(staging, "w") as f:
        f.write(version + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(staging, os.path.join(path, LATEST))


def _remove_other_versions(path: str, keep: str) -> None:
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if name != keep and name != LATEST and os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)


def remove_unfinished(path: str | os.PathLike) -> list[str]:
    """Removes the version folders under ``path`` that ``LATEST`` does not name: saves that were
    cut short (the next successful save would remove them too). Call it only while no save runs.

    Returns:
        The folders removed.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        return []
    keep = None
    with contextlib.suppress(OSError), open(os.path.join(path, LATEST)) as f:
        keep = f.read().strip()
    removed = []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name != keep and name.startswith("v") and os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)
            removed.append(full)
    return removed


def _resolve(path: str) -> str:
    """The version folder to load: ``path`` itself, or the one ``path``/LATEST names."""
    if os.path.exists(os.path.join(path, MANIFEST)):
        return path
    latest = os.path.join(path, LATEST)
    if not os.path.exists(latest):
        raise CheckpointError(
            f"no complete checkpoint in {path}: {LATEST} is missing (a save never finished there, "
            "or this is not a fullshard checkpoint folder)"
        )
    with open(latest) as f:
        version = f.read().strip()
    folder = os.path.join(path, version)
    if not version or os.sep in version:
        raise CheckpointError(f"checkpoint {path} is damaged: {LATEST} holds {version!r}, not a version's name")
    if not os.path.exists(os.path.join(folder, MANIFEST)):
        raise CheckpointError(f"checkpoint {path}: {LATEST} names {version}, whose {MANIFEST} is missing")
    return folder


def _verify(folder: str, checksums: bool) -> None:
    """Checks the files against the manifest (sizes; CRC-32 too with ``checksums``),
    spread over the ranks; raises on every rank."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            manifest = json.load(f)
        files = dict(manifest["files"])
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(f"checkpoint {folder} is damaged: {MANIFEST} cannot be read ({exc})") from exc
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {folder}: format {manifest.get('format')} is not {FORMAT_VERSION}")
    world, rank = (dist.get_world_size(), dist.get_rank()) if _distributed() else (1, 0)
    problems = []
    for index, (name, info) in enumerate(sorted(files.items())):
        if index % world != rank:
            continue
        full = os.path.join(folder, name)
        if not os.path.exists(full):
            problems.append(f"{name} is missing")
        elif os.path.getsize(full) != info["size"]:
            problems.append(f"{name} is truncated or altered ({os.path.getsize(full)} of {info['size']} bytes)")
        elif checksums and _crc32(full) != info["crc32"]:
            problems.append(f"{name} is corrupt (CRC-32 mismatch)")
    if _distributed():
        problems = [p for part in comm.all_gather_objects(problems) for p in part]
    if problems:
        raise CheckpointError(f"checkpoint {folder} is damaged: " + "; ".join(problems))


def _drop_states_not_saved(optim_state: dict[str, Any], folder: str) -> None:
    """Leaves out the parameters the checkpoint has no optimizer state for (never
    stepped when it was saved, e.g. unused so far): after loading they have none,
    as in the uninterrupted run, instead of the placeholder states."""
    prefix = "optim.state."
    saved = {
        key[len(prefix) :].rsplit(".", 1)[0]
        for key in FileSystemReader(folder).read_metadata().state_dict_metadata
        if key.startswith(prefix)
    }
    for fqn in [fqn for fqn in optim_state["state"] if fqn not in saved]:
        del optim_state["state"][fqn]


def _init_optimizer_states(optimizer: torch.optim.Optimizer) -> None:
    """Creates the optimizer's states (DCP loads into existing tensors) without
    changing any parameter: one step with zero gradients and zero learning rates."""
    if optimizer.state:
        return
    learning_rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for param in group["params"]:
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, learning_rates):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def load(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, verify: bool = False
) -> Any:
    """Loads the newest complete checkpoint under ``path`` into ``model`` (and ``optimizer``).

    Works at any world size and strategy, and for a plain model in a single
    process. A collective when distributed.

    Args:
        path: the checkpoint folder given to ``save`` (or one version in it).
        model, optimizer: what to load into (the optimizer may be fresh).
        verify: check every file's CRC-32 before loading (reads the data
            twice); sizes are always checked.

    Returns:
        The ``extra`` object saved with it (None if there was none).

    Raises:
        CheckpointError: no complete checkpoint, or a missing / truncated /
            corrupt file (named in the message).
    """
    folder = _resolve(os.fspath(path))
    _verify(folder, checksums=verify)
    if optimizer is not None:
        _init_optimizer_states(optimizer)
    states = _states(model, optimizer)  # DCP copies into these in place: no aliases needed
    if optimizer is not None:
        _drop_states_not_saved(states["optim"], folder)
    try:
        with _single_process_is_intended():
            dcp.load(states, checkpoint_id=folder, no_dist=not _distributed())
    except (Exception, CheckpointException) as exc:  # DCP's derives from BaseException
        _verify(folder, checksums=True)  # names a damaged file, if one is the cause
        raise CheckpointError(f"checkpoint {folder} does not fit this model: {_first_failure(exc)}") from exc
    with _sharded_form(model):
        model.load_state_dict(states["model"])
    if optimizer is not None:
        optimizer.load_state_dict(optim_state_dict_to_load(model, optimizer, states["optim"]))
    return _read_extra(folder)


def _first_failure(exc: BaseException) -> str:
    """The cause behind DCP's CheckpointException (which lists every rank's failure with its traceback)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))  # (exception, its frames) in torch 2.13
        inner = first[0] if isinstance(first, tuple) and first else getattr(first, "exception", first)
        return f"{type(inner).__name__}: {inner}"
    return str(exc)


def exists(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a complete checkpoint (one ``load`` would find)."""
    try:
        _resolve(os.fspath(path))
    except CheckpointError:
        return False
    return True


def read_extra(path: str | os.PathLike) -> Any:
    """The ``extra`` of the newest complete checkpoint under ``path``, without loading any tensor.

    Lets a program check what it is about to resume (a step, a configuration)
    before it builds the model. Not a collective.

    Raises:
        CheckpointError: no complete checkpoint under ``path``.
    """
    return _read_extra(_resolve(os.fspath(path)))


def _read_extra(folder: str) -> Any:
    extra_path = os.path.join(folder, EXTRA)
    if not os.path.exists(extra_path):
        return None
    try:
        return torch.load(extra_path, weights_only=False)
    except Exception as exc:  # truncated or overwritten: pickle's and torch's errors vary
        raise CheckpointError(f"checkpoint {folder} is damaged: {EXTRA} cannot be read ({exc})") from exc
