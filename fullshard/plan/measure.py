"""A choice run for real on this rank: peak memory, bytes moved and step time, to hold ``plan``'s prediction against.

Run on every rank of a process group (the rank pool's gloo ranks, or torch's
fake group for world sizes no machine here spawns): the model is built on
the CPU, sharded by ``apply_choice``, stepped with AdamW twice (the optimizer
states exist and prefetch knows the order), then measured as [Note: Measured
step memory on CPU] says (``fullshard/training/tensor_peak.py``): the live
bytes before the step (shards, optimizer states, buffers) plus the largest
rise during it, the least of three steps. A step's time is also taken as the
process's CPU seconds (every thread: the collectives' too), which a shared
machine's load changes far less than the wall clock.
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

__all__ = ["ChoiceRun", "measure_choice"]


class ChoiceRun:
    """``choice`` applied to a fresh model on this rank, with AdamW and its batches, ready to step."""

    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        batch_fn: Callable[[int], Any],
        choice: Choice,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        unit_classes: tuple[type[nn.Module], ...] | None = None,
    ) -> None:
        torch.manual_seed(0)
        self.model = model_fn()
        blocks = [module for _, module in select_blocks(self.model, unit_classes=unit_classes)]
        apply_choice(self.model, blocks, choice, device_type="cpu")
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        torch.manual_seed(1 + dist.get_rank())
        self.batches = [batch_fn(choice.micro_batch) for _ in range(choice.accumulation)]
        self.loss_fn = loss_fn

    def step(self) -> None:
        """One optimizer step: every micro-batch's forward and backward, then AdamW."""
        for batch in self.batches:
            step_loss(self.model, batch, self.loss_fn).backward()
        self.optim.step()
        self.optim.zero_grad()

    def memory(self) -> tuple[int, int, dict[str, int]]:
        """(peak, late release, bytes by collective) after two warm-up steps (``warmed_step_peak``)."""
        return warmed_step_peak(self.step, self.model, self.optim, count_buffers=True)

    def timed_step(self) -> tuple[float, float]:
        """(wall seconds, CPU seconds of this process) of one step."""
        start, start_cpu = time.perf_counter(), time.process_time()
        self.step()
        return time.perf_counter() - start, time.process_time() - start_cpu


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
    run = ChoiceRun(model_fn, batch_fn, choice, loss_fn, unit_classes)
    peak, late_release, nbytes = run.memory()
    times = [run.timed_step() for _ in range(timed_steps)]
    seconds, cpu = sorted(t for t, _ in times), sorted(c for _, c in times)
    return {
        "peak": peak,
        "late_release": late_release,
        "comm": nbytes,
        "seconds": seconds[len(seconds) // 2] if seconds else 0.0,
        "cpu_seconds": cpu[len(cpu) // 2] if cpu else 0.0,
    }
