"""The run's checkpoints: what is saved with the model and optimizer, and when a run may resume.

``extra`` holds the step, the model's dimensions and the loss scaler's state;
the data order and the learning rate are functions of the step, so nothing
else is needed to continue the loss curve exactly.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import checkpoint
from ..grad_scaler import ShardedGradScaler
from .config import TrainConfig

__all__ = ["check_checkpoint_dir", "resume", "save", "saved_step"]


def check_checkpoint_dir(config: TrainConfig) -> None:
    """Refuses to overwrite a checkpoint by accident, to resume from nothing, or into another model.

    Raises:
        ValueError: naming the flag to change.
    """
    if not config.checkpoint_dir:
        return
    found = checkpoint.exists(config.checkpoint_dir)
    if config.resume and not found:
        raise ValueError(f"--resume: no complete checkpoint in {config.checkpoint_dir}")
    if not found:
        return
    extra = checkpoint.read_extra(config.checkpoint_dir)
    if not config.resume:
        raise ValueError(
            f"{config.checkpoint_dir} already holds a checkpoint (step {extra['step']}): add --resume to "
            "continue it, or choose another --checkpoint-dir"
        )
    if extra["model"] != dataclasses.asdict(config.model_args()):
        raise ValueError(
            f"the checkpoint in {config.checkpoint_dir} holds another model ({extra['model']}): resume with "
            "the same --model/--layers/--dim/--heads/--seq"
        )


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
    }
    checkpoint.save(config.checkpoint_folder, model, optimizer, extra=extra)


def saved_step(config: TrainConfig) -> int | None:
    """The step of the newest complete checkpoint, if there is one."""
    if not config.checkpoint_dir or not checkpoint.exists(config.checkpoint_dir):
        return None
    return checkpoint.read_extra(config.checkpoint_dir)["step"]
