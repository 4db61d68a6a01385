"""The most bytes of live CPU tensors during a block of code, from the profiler's allocation events.

[Note: Measured step memory on CPU]
A rank's memory in a step is the bytes of live tensors: what was alive before
the step (parameter shards and optimizer states, counted from their storages)
plus the highest rise of the CPU allocator's running total of live bytes
during the step, read from the profiler (``profile_memory=True``), which
records every allocation and free with that total. Freed-but-cached memory and
the Python heap do not count, so the figure means what CUDA's
``max_memory_allocated`` means and what ``fullshard plan`` predicts. The
allocator's reporter only hears frees on threads the profiler follows, and
gloo's worker threads sometimes drop the last reference to a collective's
tensors: FLAGS_caffe2_report_cpu_memory_usage makes it track every thread.
That late release can lift one step's peak by up to one unit-sized buffer
(timing, not the engine's allocation pattern): tests keep the least of three.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import sys
import tempfile
from collections.abc import Iterator

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["TensorPeak"]


@contextlib.contextmanager
def _allocator_tracks_every_thread() -> Iterator[None]:
    """Sets c10's FLAGS_caffe2_report_cpu_memory_usage for the block."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    flag = ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage")
    flag.value = True
    try:
        yield
    finally:
        flag.value = False


# What the profiler's C++ side prints about itself on every start, stop and free of a tensor
# older than the window: a progress bar should not be broken by them.
_PROFILER_CHATTER = re.compile(
    r"USDT:[^\n]*?SyncActivityProfilerHandler\.cpp:\d+\] profiler_(?:start|stop)\n?"
    r"|(?:\[rank\d+\]:)?\[W[^\]]*CPUAllocator\.cpp:\d+\] Memory block of unknown size[^\n]*\n?"
)


@contextlib.contextmanager
def _without_profiler_chatter() -> Iterator[None]:
    """Captures file descriptor 2 (where C++ logs go) for the block and passes on all of it
    but the profiler's chatter, so nothing else a step prints is lost."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = _PROFILER_CHATTER.sub("", capture.read().decode(errors="replace"))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()


class TensorPeak:
    """``with TensorPeak() as peak: ...`` then ``peak.rise``: bytes above the live total at the start."""

    rise: int = 0

    def __enter__(self) -> TensorPeak:
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(_without_profiler_chatter())
        self._stack.enter_context(_allocator_tracks_every_thread())
        self._profile = self._stack.enter_context(profile(activities=[ProfilerActivity.CPU], profile_memory=True))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        totals = []  # (time, bytes allocated by the event, live total after it)
        stack = list(self._profile.profiler.kineto_results.experimental_event_tree())
        while stack:
            event = stack.pop()
            stack.extend(event.children)
            if event.typed[0] == torch._C._profiler._EventType.Allocation:
                totals.append((event.start_time_ns, event.typed[1].alloc_size, event.typed[1].total_allocated))
        if totals:
            totals.sort()
            start_total = totals[0][2] - totals[0][1]
            self.rise = max(total for _, _, total in totals) - start_total
