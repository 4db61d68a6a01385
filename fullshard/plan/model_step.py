"""How a user's model is called and its loss taken, the same in the trace, the measurement and ``train --auto``.

The batch is passed as the model's keyword arguments (a dict), its positional
arguments (a tuple or list), or its one argument (anything else). The loss is
``loss_fn(model, batch)`` when given; otherwise the output's ``loss``
(transformers models given ``labels``), a scalar output as it is, or the mean
of the first floating output (enough for memory and time; pass ``loss_fn``
for a loss whose own buffers matter, such as a cross-entropy's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

__all__ = ["call_model", "checkpoint_blocks", "step_loss"]


def call_model(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def output_loss(output: Any) -> torch.Tensor:
    """The default loss of a model's output (see the module's docstring)."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    floating = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floating:
        raise ValueError(
            f"plan expects the model to return a floating tensor (or an output with .loss) but got "
            f"{type(output).__name__}: pass loss_fn(model, batch) -> scalar"
        )
    return floating[0] if floating[0].dim() == 0 else floating[0].mean()


def step_loss(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    on_output: Callable[[Any], None] | None = None,
) -> torch.Tensor:
    """The scalar one training step calls ``backward()`` on; ``on_output`` sees the model's output
    first (the trace marks the root's forward done there)."""
    if loss_fn is not None:
        if on_output is not None:
            handle = model.register_forward_hook(lambda module, args, output: on_output(output))
            try:
                return loss_fn(model, batch)
            finally:
                handle.remove()
        return loss_fn(model, batch)
    output = call_model(model, batch)
    if on_output is not None:
        on_output(output)
    return output_loss(output)


def checkpoint_blocks(blocks: Iterable[nn.Module], preserve_rng_state: bool = True) -> None:
    """Activation checkpointing on each block: its forward runs under ``torch.utils.checkpoint``
    (non-reentrant), keeping only its inputs; backward runs it again. The module's hooks (a unit's)
    stay outside, so the unit gathers once for both."""
    for block in blocks:
        block.forward = functools.partial(
            checkpoint, block.forward, use_reentrant=False, preserve_rng_state=preserve_rng_state
        )
