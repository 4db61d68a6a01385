"""A choice run for real on this rank: peak memory, bytes moved and step time, to hold ``plan``'s prediction against.

Run on every rank of a process group (the rank pool's gloo ranks, or torch's
fake group for world sizes no machine here spawns): the model is built on
the CPU, sharded by ``apply_choice``, stepped with AdamW twice (the optimizer
states exist and prefetch knows the order), then measured as [Note: Measured
step memory on CPU] says (``fullshard/training/tensor_peak.py``): the live
bytes before the step (shards, optimizer states, buffers) plus the largest
rise during it, the least of three steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..testing.memory import warmed_step_peak
from .apply import apply_choice
from .blocks import select_blocks
from .choice import Choice
from .model_step import step_loss

__all__ = ["measure_choice"]


def measure_choice(
    model_fn: Callable[[], nn.Module],
    batch_fn: Callable[[int], Any],
    choice: Choice,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    timed_steps: int = 0,
    unit_classes: tuple[type[nn.Module], ...] | None = None,
) -> dict:
    """This rank's measured step under ``choice``: ``peak`` bytes, ``late_release`` (how much the
    three steps' peaks differ), ``comm`` bytes by collective, ``seconds`` per step (the median
    of ``timed_steps`` steps, 0 for none), and the CPU seconds of those steps."""
    torch.manual_seed(0)
    model = model_fn()
    blocks = [module for _, module in select_blocks(model, unit_classes=unit_classes)]
    apply_choice(model, blocks, choice, device_type="cpu")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.manual_seed(1 + dist.get_rank())
    batches = [batch_fn(choice.micro_batch) for _ in range(choice.accumulation)]

    def step() -> None:
        for batch in batches:
            step_loss(model, batch, loss_fn).backward()
        optim.step()
        optim.zero_grad()

    peak, late_release, nbytes = warmed_step_peak(step, model, optim, count_buffers=True)
    seconds, cpu = [], []
    for _ in range(timed_steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {
        "peak": peak,
        "late_release": late_release,
        "comm": nbytes,
        "seconds": sorted(seconds)[len(seconds) // 2] if seconds else 0.0,
        "cpu_seconds": sorted(cpu)[len(cpu) // 2] if cpu else 0.0,
    }
