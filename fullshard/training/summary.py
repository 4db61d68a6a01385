"""The record of a ``fullshard train`` run: progress-bar text, the closing table, the JSON summary.

The table puts each rank's memory next to the unsharded model's: the model
states (parameters, gradients, AdamW states) one process would hold, and the
peak ``fullshard plan`` predicts for one process with the same per-rank batch.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from .._text import align, describe_model, human_bytes
from ..plan import Plan, PlanConfig, estimate
from .config import TrainConfig

__all__ = ["CLIP_LABEL", "RunResult", "predict", "print_summary", "strategy_label"]

_LOSS_WINDOW = 10  # steps averaged into the reported final loss
# The label of the collectives the gradient clip issues (the global norm's all-reduce), which
# fullshard plan does not count: RunResult.comm's keys are "<op>" and "<op> <CLIP_LABEL>".
CLIP_LABEL = "(clip)"
_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class RunResult:
    """What a run did, the same on every rank (statistics are agreed on every step)."""

    config: TrainConfig
    world_size: int
    start_step: int
    steps_done: int
    device: str = "cpu"  # where the step ran: "cuda" peaks are the allocator's max_memory_allocated
    shard_size: int = 1  # ranks a parameter is split across (TrainConfig.shard_group_size)
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    model_states: list[int] = field(default_factory=list)
    comm: dict[str, int] = field(default_factory=dict)
    checkpoint_step: int | None = None
    interrupted: bool = False
    validation_loss: float | None = None
    sample: str | None = None

    def record_step(self, loss: float, seconds: float, peaks: list[int], model_states: list[int]) -> None:
        """One finished step; ``peaks`` and ``model_states`` hold every rank's bytes."""
        self.losses.append(loss)
        self.step_seconds.append(seconds)
        self.peaks, self.model_states = peaks, model_states
        self.steps_done += 1

    @property
    def tokens_per_step(self) -> int:
        return self.config.batch * self.config.model_args().max_seq_len

    def tokens_per_second(self) -> float:
        """Over the steps after the first (which pays for warm-up)."""
        timed = self.step_seconds[1:] or self.step_seconds
        return self.tokens_per_step * len(timed) / max(sum(timed), 1e-9)

    def final_loss(self) -> float:
        window = self.losses[-_LOSS_WINDOW:]
        return sum(window) / len(window)

    def progress_text(self) -> str:
        if not any(self.peaks):
            memory = "(measured in step 2)"
        elif len(self.peaks) <= 4:
            memory = "/".join(human_bytes(p) for p in self.peaks)
        else:
            memory = f"max {human_bytes(max(self.peaks))}"
        recent = self.step_seconds[-_LOSS_WINDOW:]
        speed = self.tokens_per_step * len(recent) / max(sum(recent), 1e-9)
        return f"loss {self.losses[-1]:.4f}, {speed:,.0f} tok/s, peak mem {memory}"

    def as_json(self) -> dict[str, Any]:
        return {
            "config": dataclasses.asdict(self.config),
            "world_size": self.world_size,
            "shard_size": self.shard_size,
            "device": self.device,
            "start_step": self.start_step,
            "steps_done": self.steps_done,
            "interrupted": self.interrupted,
            "final_loss": self.final_loss() if self.losses else None,
            "validation_loss": self.validation_loss,
            "tokens_per_s": self.tokens_per_second() if self.step_seconds else None,
            "peak_memory": self.peaks,
            "model_state_bytes": self.model_states,
            "comm_bytes_per_step": self.comm,
            "unsharded_model_state_bytes": unsharded_model_state_bytes(self.config),
            "checkpoint_step": self.checkpoint_step,
        }


def unsharded_model_state_bytes(config: TrainConfig) -> int:
    """fp32 parameters, gradients and AdamW's two states of the whole model, in one process."""
    return config.model_args().num_params * 4 * 4


def predict(config: TrainConfig, world_size: int, shard_size: int, device: str) -> tuple[Plan, Plan]:
    """``fullshard plan``'s figures for this run (per rank), and for one unsharded process."""
    compute = _DTYPES[config.mixed_precision]

    def plan(world: int, strategy: str, shard: int) -> PlanConfig:
        return PlanConfig(
            config.model_args(),
            world,
            strategy,
            ranks_per_node=shard,
            batch_size=config.batch // world_size,
            param_dtype=compute,
            reduce_dtype=torch.float32 if compute else None,
            cpu_offload=config.cpu_offload,
            all_gather_dtype=config.all_gather_code,
            flat_params=config.front_end == "wrapper",
            device="cuda" if device == "cuda" else "cpu",
        )

    return estimate(plan(world_size, config.strategy, shard_size)), estimate(plan(1, "no-shard", 1))


def strategy_label(strategy: str, world_size: int, shard_size: int) -> str:
    """What the strategy did at this size: hybrid with one shard group is full sharding, with
    groups of one rank it is replication; one rank shards nothing."""
    if world_size == 1:
        return f"strategy {strategy} (one rank: nothing sharded or replicated)"
    if strategy != "hybrid":
        return f"strategy {strategy}"
    if shard_size == world_size:
        return f"strategy hybrid as full (one shard group of all {world_size} ranks, no replicas)"
    if shard_size == 1:
        return f"strategy hybrid as no-shard (shard groups of 1 rank: {world_size} replicas)"
    return f"strategy hybrid ({world_size // shard_size} replicas of {shard_size}-rank shard groups)"


def print_summary(result: RunResult) -> None:
    config = result.config
    precision = "fp32" if config.mixed_precision == "none" else f"{config.mixed_precision} compute, fp32 reduce"
    offload = ", CPU offload" if config.cpu_offload else ""
    if config.front_end == "wrapper":
        offload += ", FSDP1 wrapper (flat parameters)"
    if config.all_gather_dtype != "none" and result.shard_size > 1:  # else no all-gather ran
        offload += f", weights gathered as {config.all_gather_dtype}"
    predicted, alone = predict(config, result.world_size, result.shard_size, result.device)
    lines = [
        "",
        f"{config.model}: {describe_model(config.model_args())}",
        f"{result.world_size} rank{'s' if result.world_size > 1 else ''}, "
        f"{strategy_label(config.strategy, result.world_size, result.shard_size)}, "
        f"{precision}{offload}; "
        f"{config.batch} x {config.model_args().max_seq_len} tokens per step",
    ]
    if result.interrupted:
        lines.append(f"interrupted (Ctrl-C) after step {result.steps_done} of {config.steps}")
    ran = result.steps_done - result.start_step
    resumed = f" (resumed at step {result.start_step})" if result.start_step else ""
    rows = [["steps", f"{result.steps_done}{resumed}"]]
    if ran:
        rows += [
            ["final loss", f"{result.final_loss():.4f} (mean of the last {min(ran, _LOSS_WINDOW)} steps)"],
            ["throughput", f"{result.tokens_per_second():,.0f} tokens/s"],
            ["comm per step and rank", _comm_text(result, predicted)],
        ]
    if result.validation_loss is not None:
        rows.append(["validation loss", f"{result.validation_loss:.4f}"])
    if result.checkpoint_step is not None:
        rows.append(["checkpoint", f"{config.checkpoint_dir} (step {result.checkpoint_step})"])
    width = max(len(label) for label, _ in rows) + 2
    lines += [""] + [f"{label:<{width}}{value}" for label, value in rows]
    if ran:
        lines += ["", _memory_table(result, predicted, alone)]
    if result.sample is not None:
        lines += ["", "sample: " + repr(result.sample)]
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:  # the reader went away (`| head`): the run itself succeeded
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to tell it, at exit either


def _comm_text(result: RunResult, predicted: Plan) -> str:
    """The sharding's collectives (which ``fullshard plan`` predicts), then the clip's norm all-reduce."""
    sharding = {op: n for op, n in result.comm.items() if not op.endswith(CLIP_LABEL)}
    text = human_bytes(sum(sharding.values())) + "".join(
        f", {op} {human_bytes(n)}" for op, n in sorted(sharding.items())
    )
    text += f" (fullshard plan: {human_bytes(predicted.comm_bytes)})"
    clip = sum(n for op, n in result.comm.items() if op.endswith(CLIP_LABEL))
    return text + (f"; the clip's norm: all_reduce {human_bytes(clip)}" if clip else "")


def _memory_table(result: RunResult, plan: Plan, alone: Plan) -> str:
    predicted, predicted_alone = plan.peak, alone.peak
    measured = "peak, max_memory_allocated" if result.device == "cuda" else "peak, measured"
    rows = [["memory", "model states", measured, "peak, predicted"]]
    ranks = range(result.world_size) if result.world_size <= 8 else [0, result.world_size - 1]
    for rank in ranks:
        rows.append(
            [
                f"rank {rank}",
                human_bytes(result.model_states[rank]),
                human_bytes(result.peaks[rank]),
                human_bytes(predicted),
            ]
        )
    rows.append(
        [
            "one process, unsharded",
            human_bytes(unsharded_model_state_bytes(result.config)),
            "-",
            human_bytes(predicted_alone),
        ]
    )
    return align(rows) + (
        "\n(model states: parameters, gradients and AdamW states; peak: the most a step holds at once"
        + (" on the GPU" if result.device == "cuda" else " in live tensors, measured in step 2 on CPU")
        + "; predictions: fullshard plan)"
    )
