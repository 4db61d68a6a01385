"""What a training run measures on each rank: peak memory, bytes communicated, model-state bytes."""

from __future__ import annotations

import collections
import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._core import comm
from .tensor_peak import TensorPeak

__all__ = ["CommTally", "MetricsFile", "PeakMemory", "model_state_bytes"]


class PeakMemory:
    """This rank's peak memory in a training step, in live tensor bytes.

    CUDA: the allocator's high-water mark (``max_memory_allocated``). CPU: one
    step (``probe``) is measured as the tensors it started with (parameter
    shards, optimizer states) plus the highest rise of live tensor bytes the
    profiler's allocation events show (see [Note: Measured step memory on
    CPU]); freed memory that glibc keeps and the Python heap do not count, so
    the figure is the one ``fullshard plan`` predicts.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._measured: int | None = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    @contextlib.contextmanager
    def probe(self, tensors_at_start: int) -> Iterator[None]:
        """Measures the step run inside (CPU); ``tensors_at_start``: bytes of live tensors."""
        if self.device.type == "cuda":
            yield
            return
        with TensorPeak() as peak:
            yield
        self._measured = tensors_at_start + peak.rise

    def peak(self) -> int | None:
        """Bytes, or None on CPU before the probe step."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self._measured


class CommTally:
    """Bytes (and calls) of the collectives per operation, between ``reset`` calls; those issued inside
    ``labelled(label)`` count under ``"<op> <label>"``."""

    def __init__(self) -> None:
        self.bytes: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self._suffix = ""

    @contextlib.contextmanager
    def labelled(self, label: str) -> Iterator[None]:
        self._suffix = f" {label}"
        try:
            yield
        finally:
            self._suffix = ""

    @contextlib.contextmanager
    def listening(self) -> Iterator[CommTally]:
        remove = comm.add_listener(self._record)
        try:
            yield self
        finally:
            remove()

    def _record(self, record: comm.CommRecord, tensors: list[torch.Tensor]) -> None:
        self.bytes[record.op + self._suffix] += record.nbytes
        self.calls[record.op + self._suffix] += 1

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
    """JSON lines on rank 0, appended: one per step, then one summary. Lines already in the file
    stay; a resumed run first drops the interrupted run's lines past its checkpoint (its steps
    after that one and its summary), so that the file holds one continuous curve."""

    def __init__(self, path: str | None, resumed_at: int) -> None:
        self._file = None
        if path is None:
            return
        if resumed_at > 0:
            _drop_tail_after_step(path, resumed_at)
        self._file = open(path, "a")

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _drop_tail_after_step(path: str, step: int) -> None:
    """Cuts ``path`` after its last line of ``step`` when everything after it is the tail of that
    run (later steps, a summary); any other content is left as it is."""
    try:
        with open(path) as f:
            lines = f.readlines()
        records = [json.loads(line) for line in lines]
    except (FileNotFoundError, ValueError):  # nothing there, or not a metrics file: only append
        return
    ends = [i for i, record in enumerate(records) if isinstance(record, dict) and record.get("step") == step]
    if not ends:
        return
    tail = records[ends[-1] + 1 :]
    if not tail or not all(isinstance(r, dict) and ("summary" in r or r.get("step", 0) > step) for r in tail):
        return
    staging = f"{path}.{os.getpid()}.tmp"
    with open(staging, "w") as f:
        f.writelines(lines[: ends[-1] + 1])
    os.replace(staging, path)
