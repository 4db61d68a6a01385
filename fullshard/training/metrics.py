"""What a training run measures on each rank: peak memory, bytes communicated, model-state bytes."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._core import comm

__all__ = ["CommTally", "MetricsFile", "PeakMemory", "model_state_bytes"]


class PeakMemory:
    """This rank's peak memory in a training step.

    CUDA: the allocator's high-water mark. CPU: glibc keeps freed memory for
    reuse, so the resident set alone says little about live tensors. One
    step (``probe``) therefore runs with freed blocks handed back to the OS at
    once; its peak is what the step started with in tensors (parameter
    shards, optimizer states) plus how far the resident set rose. Afterwards
    the allocator gets a fast setting back. Without glibc the peak is the
    resident set's rise since construction, an upper bound.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._libc = _glibc() if device.type == "cpu" else None
        self._baseline = _status_bytes("VmRSS")
        self._measured: int | None = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    @contextlib.contextmanager
    def probe(self, tensors_at_start: int) -> Iterator[None]:
        """Measures the step run inside (CPU); ``tensors_at_start``: bytes of live tensors."""
        if self._libc is None:
            yield
            return
        self._libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
        self._libc.mallopt(_M_TRIM_THRESHOLD, 0)
        self._libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        start = _status_bytes("VmRSS")
        try:
            yield
        finally:
            self._measured = tensors_at_start + _status_bytes("VmHWM") - start
            self._libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
            self._libc.mallopt(_M_TRIM_THRESHOLD, 2 * _MMAP_THRESHOLD_MAX)

    def peak(self) -> int | None:
        """Bytes, or None on CPU before the probe step."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        if self._libc is None:
            return max(0, _status_bytes("VmHWM") - self._baseline)
        return self._measured


# glibc's mallopt parameters (malloc.h), and the largest mmap threshold it picks by itself on 64-bit.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (present only in glibc)
    except (OSError, AttributeError):
        return None
    return libc if os.path.exists("/proc/self/clear_refs") else None


def _status_bytes(field: str) -> int:
    """A field of /proc/self/status in bytes (0 where there is no /proc)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class CommTally:
    """Bytes (and calls) of the engine's collectives per operation, between ``reset`` calls."""

    def __init__(self) -> None:
        self.bytes: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def listening(self) -> Iterator[CommTally]:
        remove = comm.add_listener(self._record)
        try:
            yield self
        finally:
            remove()

    def _record(self, record: comm.CommRecord, tensors: list[torch.Tensor]) -> None:
        self.bytes[record.op] += record.nbytes
        self.calls[record.op] += 1

    def reset(self) -> dict[str, int]:
        """The bytes per operation so far; starts counting again."""
        counted = dict(self.bytes)
        self.bytes.clear()
        self.calls.clear()
        return counted


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of the parameters and the optimizer states."""
    return {
        "params": sum(_local_bytes(p) for p in model.parameters()),
        "optimizer": sum(
            _local_bytes(value)
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ),
    }


class MetricsFile:
    """JSON lines on rank 0: one per step, then one summary. A resumed run first drops the
    lines past its checkpoint, so the file holds one continuous curve."""

    def __init__(self, path: str | None, resumed_at: int) -> None:
        self._file = None
        if path is None:
            return
        kept: list[str] = []
        if resumed_at > 0:
            with contextlib.suppress(FileNotFoundError), open(path) as f:
                kept = [line for line in f if json.loads(line).get("step", resumed_at + 1) <= resumed_at]
        self._file = open(path, "w")
        self._file.writelines(kept)
        self._file.flush()

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
