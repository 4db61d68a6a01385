"""The run's checkpoints: what is saved with the model and optimizer, and when a run may resume.

``extra`` holds the step, the model's dimensions and the loss scaler's state;
the data order and the learning rate are functions of the step, so nothing
else is needed to continue the loss curve exactly.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from .. import checkpoint
from ..grad_scaler import ShardedGradScaler
from .config import TrainConfig

__all__ = ["check_checkpoint_dir", "checkpoint_problems", "remove_unfinished_saves", "resume", "save", "saved_step"]


def checkpoint_problems(config: TrainConfig) -> tuple[list[str], list[str]]:
    """What ``--checkpoint-dir`` and ``--resume`` would do: (errors, notices), one line each.

    Errors: overwriting a checkpoint by accident, resuming from nothing, into
    another model, or to a ``--steps`` already passed. Notices: what is resumed,
    and a learning-rate schedule that a changed ``--steps``/``--lr``/``--warmup``
    plans anew, or batches that a changed ``--batch``/``--seed`` draws anew.
    """
    if not config.checkpoint_dir:
        return [], []
    try:
        extra = checkpoint.read_extra(config.checkpoint_dir)
    except checkpoint.CheckpointError as exc:
        if _holds_none(config.checkpoint_dir):  # a new folder, or only saves that never finished
            return ([f"--resume: no complete checkpoint in {config.checkpoint_dir}"] if config.resume else []), []
        return [
            f"--checkpoint-dir {config.checkpoint_dir}: {exc}; choose another --checkpoint-dir, or remove this one"
        ], []
    if not isinstance(extra, dict) or not {"step", "model"} <= extra.keys():
        return [
            f"--checkpoint-dir {config.checkpoint_dir} holds a checkpoint that fullshard train did not write "
            "(its extra has no step and model): choose another --checkpoint-dir"
        ], []
    step = extra["step"]
    if not config.resume:
        return [
            f"{config.checkpoint_dir} already holds a checkpoint (step {step}): add --resume to "
            "continue it, or choose another --checkpoint-dir"
        ], []
    errors = []
    if extra["model"] != dataclasses.asdict(config.model_args()):
        saved = extra["model"]
        flags = " ".join(
            f"--{flag} {saved[field]}"
            for flag, field in (("layers", "n_layers"), ("dim", "dim"), ("heads", "n_heads"), ("seq", "max_seq_len"))
            if field in saved
        )
        errors.append(
            f"the checkpoint in {config.checkpoint_dir} holds another model ({flags}, vocabulary "
            f"{saved.get('vocab_size')}): resume with the flags that built it"
        )
    if config.steps < step:
        errors.append(
            f"--steps {config.steps} is below the checkpoint's step {step} in {config.checkpoint_dir}: "
            f"nothing would train; pass --steps above {step}"
        )
    if errors:
        return errors, []
    notices = [f"resuming {config.checkpoint_dir} at step {step} of {config.steps}"]
    if config.steps == step:
        notices[0] += ": no step left to train (validation and --sample only)"
    changes = (
        ("schedule", _schedule(config), "the learning-rate schedule changes", "the rate follows the new one"),
        ("data", _data(config), "the data changes", "each step's batch is drawn by the new settings"),
    )
    for key, now, what, effect in changes:
        saved = extra.get(key)
        if saved is not None and saved != now:
            changed = ", ".join(f"--{k} {saved[k]:g} -> {now[k]:g}" for k in now if saved.get(k) != now[k])
            notices.append(
                f"warning: {what} ({changed}): from step {step} on, {effect}, so the loss curve differs from an "
                "uninterrupted run"
            )
    return [], notices


def _holds_none(path: str) -> bool:
    """No checkpoint was ever completed in ``path`` (neither LATEST nor a version's manifest there)."""
    return not any(os.path.exists(os.path.join(path, name)) for name in (checkpoint.LATEST, checkpoint.MANIFEST))


def check_checkpoint_dir(config: TrainConfig) -> None:
    """Raises ValueError (naming the flags to change) for the errors of ``checkpoint_problems``."""
    errors, _ = checkpoint_problems(config)
    if errors:
        raise ValueError("\n".join(errors))


def _schedule(config: TrainConfig) -> dict[str, float]:
    """What ``learning_rate`` reads besides the step."""
    return {"steps": config.steps, "lr": config.lr, "warmup": config.warmup}


def _data(config: TrainConfig) -> dict[str, float]:
    """What the batches of a step depend on besides the step (``Corpus.batch``)."""
    return {"batch": config.batch, "seed": config.seed}


def resume(
    config: TrainConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: ShardedGradScaler | None
) -> int:
    """Loads the newest checkpoint when resuming; returns the number of steps already done."""
    if not config.resume:
        return 0
    check_checkpoint_dir(config)
    extra = checkpoint.load(config.checkpoint_folder, model, optimizer)
    if scaler is not None and extra.get("scaler"):
        scaler.load_state_dict(extra["scaler"])
    return extra["step"]


def save(
    config: TrainConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: ShardedGradScaler | None,
    step: int,
) -> None:
    extra = {
        "step": step,
        "model": dataclasses.asdict(config.model_args()),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "schedule": _schedule(config),
        "data": _data(config),
    }
    checkpoint.save(config.checkpoint_folder, model, optimizer, extra=extra)


def saved_step(config: TrainConfig) -> int | None:
    """The step of the newest complete checkpoint, if there is one."""
    if not config.checkpoint_dir:
        return None
    try:
        extra = checkpoint.read_extra(config.checkpoint_dir)
    except checkpoint.CheckpointError:  # none, or a damaged one: nothing to resume from
        return None
    return extra.get("step") if isinstance(extra, dict) else None


def remove_unfinished_saves(config: TrainConfig) -> list[str]:
    """Removes what saves cut short left in ``--checkpoint-dir`` (version folders that LATEST does not
    name); call it only when no rank runs. Returns the removed folders."""
    if not config.checkpoint_dir:
        return []
    return checkpoint.remove_unfinished(config.checkpoint_dir)
