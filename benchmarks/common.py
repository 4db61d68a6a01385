"""Measurement helpers shared by the benchmark scripts.

Peak memory on CPU: the kernel's resident-set high-water mark, reset before a
measured section (/proc/self/clear_refs) and read after it. Memory phases run
in processes started with glibc's mmap threshold fixed at 64 KiB
(``MEMORY_ENV``), so freed tensors go back to the OS at once and the mark
tracks live memory rather than allocator caches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def status_bytes(field: str) -> int:
    """A ``VmRSS``/``VmHWM``-style field of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> int:
    """Resets the high-water mark; returns the resident set now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmRSS")


def peak_rise(before: int) -> int:
    """How far the resident set rose above ``before`` since the last reset."""
    return status_bytes("VmHWM") - before


def run_ranks(script: str, nproc: int, arguments: list[str], out: str, env: dict[str, str] | None = None) -> list:
    """Runs ``script`` on ``nproc`` ranks through torchrun; returns the JSON it wrote to ``out``."""
    # --standalone: torchrun picks a free port itself (no window for another process to take it).
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        script, *arguments, f"--out={out}",
    ]
    subprocess.run(command, check=True, env={**os.environ, **(env or {})})
    with open(out) as f:
        return json.load(f)
