"""``plan()``: every sharding choice for a user's model, predicted, ranked, the first one explained.

    from fullshard.plan import plan

    result = plan(lambda: MyModel(), lambda n: torch.randn(n, 3, 224, 224), world_size=64, memory_limit_gib=80)
    print(result.report())          # the table, the code of the first choice, why the others lost

Each (micro-batch, compute dtype, checkpointing) is traced once on fake
tensors (``trace.py``); every sharding choice is then a playback of that
trace (``playback.py``): milliseconds each, so the search tries them all.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn

from .._text import align, human_bytes
from .apply import choice_code
from .choice import Choice
from .playback import Prediction, predict
from .profiles import DeviceProfile, load_profile
from .step_time import StepClock
from .trace import StepTrace, trace_step
from .workspace import WorkspaceProbe

__all__ = ["ModelPlan", "candidates", "plan"]


@dataclass(frozen=True)
class ModelPlan:
    """The predictions, best first (fitting ones by step time, then the rest by peak)."""

    predictions: list[Prediction]
    memory_limit: int | None  # bytes
    profile: DeviceProfile
    num_params: int
    block_names: list[str]
    tokens_per_sample: float
    skipped: dict[str, str]  # settings whose step fails on this model -> why (the first line of the error)

    @property
    def fitting(self) -> list[Prediction]:
        return [p for p in self.predictions if self.fits(p)]

    @property
    def best(self) -> Prediction | None:
        fitting = self.fitting
        return fitting[0] if fitting else None

    def fits(self, prediction: Prediction) -> bool:
        return self.memory_limit is None or prediction.peak <= self.memory_limit

    def tokens_per_second(self, prediction: Prediction) -> float:
        choice = prediction.choice
        tokens = self.tokens_per_sample * choice.samples_per_step * choice.world_size
        return tokens / prediction.time.total if prediction.time.total else 0.0

    def table(self, rows: int = 12) -> str:
        header = ["#", "choice", "peak/rank", "fits", "step", "tokens/s", "moved/rank", "exposed comm"]
        body = []
        for rank, p in enumerate(self.predictions[:rows], 1):
            body.append(
                [
                    str(rank),
                    p.choice.label(),
                    human_bytes(p.peak),
                    "yes" if self.fits(p) else "no",
                    _seconds(p.time.total),
                    f"{self.tokens_per_second(p):,.0f}",
                    human_bytes(p.comm_bytes),
                    _seconds(p.time.exposed),
                ]
            )
        return align([header, *body])

    def why_others_lost(self) -> list[str]:
        """For each setting the first choice does not use: the best choice with it, and what it lacks."""
        best = self.best
        if best is None:
            return []
        lines = []
        for label, same in _SETTINGS:
            rivals = [p for p in self.predictions if not same(p.choice, best.choice)]
            groups: dict[str, Prediction] = {}
            for p in rivals:
                groups.setdefault(_setting_label(label, p.choice), p)  # best first: the first is the group's best
            for name, p in groups.items():
                if not self.fits(p):
                    reason = f"does not fit: {human_bytes(p.peak)} > {human_bytes(self.memory_limit or 0)}"
                else:
                    slower = p.time.total / best.time.total - 1
                    reason = f"slower by {slower:.0%} ({_seconds(p.time.total)} a step)"
                lines.append(f"{name}: {reason} (best with it: {p.choice.label()})")
        return lines

    def report(self, rows: int = 12) -> str:
        out = [self.profile.caveat, self.table(rows)]
        if len(self.predictions) > rows:
            out.append(f"... {len(self.predictions) - rows} more choices")
        best = self.best
        if best is None:
            least = min(self.predictions, key=lambda p: p.peak)
            out.append(
                f"\nno choice fits {human_bytes(self.memory_limit or 0)} per rank: the smallest peak is "
                f"{human_bytes(least.peak)} ({least.choice.label()}); more ranks, a smaller micro-batch or "
                "checkpointing would be needed"
            )
            return "\n".join(out)
        out.append(
            f"\nfirst choice: {best.choice.label()}: peak {human_bytes(best.peak)} per rank, "
            f"{_seconds(best.time.total)} a step ({_breakdown(best)})"
        )
        out.append("\n" + choice_code(best.choice, self.block_names, self.profile.device))
        out.append("\nwhy not the others:")
        out += [f"  {line}" for line in self.why_others_lost()]
        out += [f"  {setting}: the step fails on this model: {why}" for setting, why in self.skipped.items()]
        return "\n".join(out)


def _seconds(value: float) -> str:
    return f"{value * 1e3:.1f} ms" if value < 10 else f"{value:.1f} s"


def _breakdown(p: Prediction) -> str:
    return (
        f"compute {_seconds(p.time.compute)}, collectives {_seconds(p.time.communication)} of which "
        f"{_seconds(p.time.exposed)} not hidden, optimizer {_seconds(p.time.optimizer)}"
    )


_SETTINGS: list[tuple[str, Callable[[Choice, Choice], bool]]] = [
    (
        "strategy",
        lambda a, b: (a.strategy, a.hybrid_shard_size, a.reshard_to) == (b.strategy, b.hybrid_shard_size, b.reshard_to),
    ),
    ("micro-batch", lambda a, b: a.micro_batch == b.micro_batch),
    ("mixed precision", lambda a, b: a.mixed_precision == b.mixed_precision),
    ("checkpointing", lambda a, b: a.checkpointing == b.checkpointing),
    ("CPU offload", lambda a, b: a.cpu_offload == b.cpu_offload),
    ("quantized all-gather", lambda a, b: a.all_gather_dtype == b.all_gather_dtype),
]


def _setting_label(setting: str, choice: Choice) -> str:
    if setting == "strategy":
        return choice.label().split()[0]
    if setting == "micro-batch":
        return f"micro-batch {choice.micro_batch}"
    if setting == "mixed precision":
        return "bf16 compute" if choice.mixed_precision is not None else "fp32 compute"
    if setting == "checkpointing":
        return "activation checkpointing" if choice.checkpointing else "no checkpointing"
    if setting == "CPU offload":
        return "CPU offload" if choice.cpu_offload else "no offload"
    return (
        f"all-gather as {choice.all_gather_dtype}".replace("torch.", "")
        if choice.all_gather_dtype
        else "exact all-gather"
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    world_size: int,
    samples_per_rank: int,
    ranks_per_node: int = 8,
    device: str = "cuda",
    dtype: torch.dtype = torch.float32,
    strategies: Iterable[str] = ("full", "grad-op", "hybrid", "no-shard"),
    micro_batches: Iterable[int] | None = None,
    mixed_precision: Iterable[torch.dtype | None] = (None, torch.bfloat16),
    cpu_offload: Iterable[bool] = (False, True),
    checkpointing: Iterable[bool] = (False, True),
    all_gather_dtypes: Iterable[torch.dtype | None] = (None, torch.int8),
    reshard_to: bool = True,
) -> list[Choice]:
    """Every choice of the search space (hybrid: each shard size that divides the world, 1 and the
    world aside; ``reshard_after_forward=int``: the ranks of a node, when they divide the world)."""
    layouts: list[dict[str, Any]] = []
    for strategy in strategies:
        if strategy == "hybrid":
            layouts += [{"strategy": "hybrid", "hybrid_shard_size": s} for s in _divisors(world_size)[1:-1]]
        elif strategy == "no-shard" or world_size > 1:
            layouts.append({"strategy": strategy})
        if strategy == "full" and reshard_to and 1 < ranks_per_node < world_size and world_size % ranks_per_node == 0:
            layouts.append({"strategy": "full", "reshard_to": ranks_per_node})
    micro = list(micro_batches) if micro_batches is not None else _divisors(samples_per_rank)
    micro = [m for m in micro if samples_per_rank % m == 0]
    found = []
    for layout, m, mp, offload, ac, codes in itertools.product(
        layouts, micro, mixed_precision, cpu_offload, checkpointing, all_gather_dtypes
    ):
        choice = Choice(
            world_size=world_size,
            micro_batch=m,
            accumulation=samples_per_rank // m,
            mixed_precision=mp,
            cpu_offload=offload,
            checkpointing=ac,
            all_gather_dtype=codes,
            ranks_per_node=ranks_per_node,
            device=device,
            dtype=dtype,
            **layout,
        )
        if codes is not None and choice.shard_size == 1:
            continue  # no all-gather runs
        found.append(choice)
    return found


def plan(
    model_fn: Callable[[], nn.Module],
    example_batch_fn: Callable[[int], Any],
    *,
    world_size: int,
    memory_limit_gib: float | None = None,
    global_batch: int | None = None,
    ranks_per_node: int = 8,
    profile: DeviceProfile | str = "h100",
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    policy: Callable[[nn.Module], bool] | None = None,
    unit_classes: tuple[type[nn.Module], ...] | None = None,
    choices: list[Choice] | None = None,
    **space: Any,
) -> ModelPlan:
    """Predicts every choice for training ``model_fn()`` on ``world_size`` ranks and ranks them.

    Args:
        model_fn: builds the model (under fake tensors: nothing is allocated).
        example_batch_fn: ``example_batch_fn(n)`` builds ``n`` samples, one rank's micro-batch.
        world_size: ranks.
        memory_limit_gib: per-rank device memory (default: the profile's).
        global_batch: samples per optimizer step over all ranks (default: one per rank).
        ranks_per_node: ranks that share the fast links.
        profile: a ``DeviceProfile`` or a name/path for ``load_profile``.
        loss_fn: ``loss_fn(model, batch)`` -> scalar; default in ``model_step``.
        policy / unit_classes: the units (default: the repeated blocks).
        choices: the choices to predict (default: ``candidates(...)`` with ``space``).
        space: keyword arguments of ``candidates`` (``strategies``, ``micro_batches``, ...).

    Raises:
        ValueError: a global batch that the world size does not divide.
    """
    device_profile = profile if isinstance(profile, DeviceProfile) else load_profile(profile)
    batch = global_batch if global_batch is not None else world_size
    if batch % world_size:
        raise ValueError(f"plan expects a global_batch divisible by world_size {world_size} but got {batch}")
    traces: dict[tuple[int, torch.dtype | None, bool], StepTrace | None] = {}
    skipped: dict[str, str] = {}
    workspaces = WorkspaceProbe()

    def trace_of(choice: Choice) -> StepTrace | None:
        key = (choice.micro_batch, choice.mixed_precision, choice.checkpointing)
        if key not in traces:
            try:
                traces[key] = trace_step(
                    model_fn,
                    example_batch_fn,
                    choice.micro_batch,
                    choice.mixed_precision,
                    choice.checkpointing,
                    loss_fn,
                    policy,
                    unit_classes,
                    device_profile.device,
                    workspaces,
                )
            except (RuntimeError, TypeError, ValueError) as exc:  # e.g. BatchNorm's fp32 buffers under bf16
                traces[key] = None
                skipped[_setting_of(choice)] = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return traces[key]

    try:
        first = trace_step(
            model_fn, example_batch_fn, 1, None, False, loss_fn, policy, unit_classes, device_profile.device, workspaces
        )
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"plan could not run one step of the model on fake tensors: {exc}") from exc
    traces[(1, None, False)] = first
    if choices is None:
        choices = candidates(
            world_size, batch // world_size, ranks_per_node, device_profile.device, first.param_dtype, **space
        )
    predictions = []
    for choice in choices:
        choice = replace(choice, device=device_profile.device, dtype=first.param_dtype)
        trace = trace_of(choice)
        if trace is not None:
            predictions.append(predict(trace, choice, StepClock(device_profile, choice)))
    if not predictions:
        raise ValueError(f"plan could not trace any choice: {skipped}")
    limit = int((memory_limit_gib if memory_limit_gib is not None else device_profile.memory_gib) * 2**30)
    predictions.sort(key=lambda p: (p.peak > limit, p.time.total if p.peak <= limit else p.peak))
    return ModelPlan(
        predictions=predictions,
        memory_limit=limit,
        profile=device_profile,
        num_params=sum(n * row for u in first.units for n, row in u.shapes),
        block_names=[u.name for u in first.units[1:]],
        tokens_per_sample=first.tokens,
        skipped=skipped,
    )


def _setting_of(choice: Choice) -> str:
    """The traced setting that failed, in words."""
    parts = [f"micro-batch {choice.micro_batch}"]
    if choice.mixed_precision is not None:
        parts.append(str(choice.mixed_precision).removeprefix("torch.") + " compute")
    if choice.checkpointing:
        parts.append("activation checkpointing")
    return ", ".join(parts)
