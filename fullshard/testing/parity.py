"""Parity against a single-process reference: same init, data and optimizer.

Each rank trains the sharded model on its slice of every global batch and a
local copy of the unsharded model (the reference) on the whole batch. With
gradients averaged across data-parallel ranks, both see the same gradient, so
losses and parameters must agree up to floating-point reordering.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._core.compat import local_region
from ..state_dict import sharded_tensor


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The unsharded value of a (possibly DTensor or ShardedTensor) tensor (a collective for those)."""
    if isinstance(tensor, ShardedTensor):
        return sharded_tensor.full_tensor(tensor)
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()


def assert_params_equal(
    model: nn.Module,
    ref: nn.Module,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    grads: bool = False,
    match_names: bool = True,
) -> None:
    """Compares parameters (and gradients) in order; ``match_names=False`` allows
    wrapper modules that change the names but not the order."""
    named = list(model.named_parameters())
    ref_named = list(ref.named_parameters())
    assert len(named) == len(ref_named), f"{len(named)} parameters vs {len(ref_named)}"
    if match_names:
        assert [n for n, _ in named] == [n for n, _ in ref_named], "parameter names differ"
    for (name, param), (_, ref_param) in zip(named, ref_named):
        torch.testing.assert_close(*_comparable(param, ref_param), rtol=rtol, atol=atol, msg=_prefixed(name))
        if grads:
            grad, ref_grad = param.grad, ref_param.grad
            assert (grad is None) == (ref_grad is None), f"{name}: grad presence differs"
            if grad is not None and ref_grad is not None:
                torch.testing.assert_close(
                    *_comparable(grad, ref_grad), rtol=rtol, atol=atol, msg=_prefixed(f"{name}.grad")
                )


def _comparable(tensor: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two values to compare. A DTensor against the reference's plain (replicated) tensor:
    this rank's shard against the same region of the reference, with no collective (every rank
    checks its own shard, so every element is checked; a gather per parameter costs about a
    millisecond of gloo on a 2-core machine). Anything else: both unsharded."""
    if isinstance(tensor, DTensor) and not isinstance(ref, (DTensor, ShardedTensor)):
        placements = tensor.placements
        if all(type(p) in (Shard, Replicate) for p in placements) and tensor.shape == ref.shape:
            local = tensor.to_local().detach()
            region = local_region(ref.detach(), tensor.device_mesh, placements)
            if local.shape == region.shape:
                return local, region
    return full_value(tensor), full_value(ref)


def _prefixed(prefix: str) -> Callable[[str], str]:
    """An ``assert_close`` message that names what differed."""
    return lambda message: f"{prefix}: {message}"


def clone_tree(tree: Any) -> Any:
    """Every tensor in a nested dict/list cloned (a deep copy of a state dict).

    ``copy.deepcopy`` fails on DTensors whose local tensor is a view at a
    non-zero storage offset (torch >= 2.10, PR 167597), as sharded parameters
    living in a unit's flat buffer are; ``clone`` works.
    """
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {key: clone_tree(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(clone_tree(value) for value in tree)
    return copy.deepcopy(tree)


def mean_over(value: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.AVG, group=group)
    return value


def split_batch(batch: Sequence[torch.Tensor], dp_rank: int, dp_size: int) -> tuple[torch.Tensor, ...]:
    return tuple(t.chunk(dp_size)[dp_rank] for t in batch)


def train_steps(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    batches: Iterable[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
) -> list[float]:
    """One optimizer step per batch (``loss_fn(model, batch)``, backward, step, zero_grad); the losses."""
    losses = []
    for batch in batches:
        loss = loss_fn(model, batch)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def train_in_parity(
    model: nn.Module,
    ref: nn.Module,
    optim: torch.optim.Optimizer,
    ref_optim: torch.optim.Optimizer,
    batches: Iterable[Sequence[torch.Tensor]],
    loss_fn: Callable[[nn.Module, Sequence[torch.Tensor]], torch.Tensor],
    dp_rank: int | None = None,
    dp_size: int | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    num_microbatches: int = 1,
    before_microbatch: Callable[[int, bool], None] | None = None,
) -> list[float]:
    """Steps both models over ``batches`` and asserts equal losses each step.

    With ``num_microbatches > 1`` each rank's slice is split again and
    gradients accumulate; ``before_microbatch(index, is_last)`` lets the test
    switch gradient sync off for all but the last one.

    Returns the global losses.
    """
    dp_rank = dist.get_rank() if dp_rank is None else dp_rank
    dp_size = dist.get_world_size() if dp_size is None else dp_size
    losses = []
    for step, batch in enumerate(batches):
        local = split_batch(batch, dp_rank, dp_size)
        total = torch.zeros(())
        for index, micro in enumerate(zip(*(t.chunk(num_microbatches) for t in local))):
            if before_microbatch is not None:
                before_microbatch(index, index == num_microbatches - 1)
            loss = loss_fn(model, micro) / num_microbatches
            loss.backward()
            total += loss.detach().float()
        optim.step()
        optim.zero_grad()
        ref_loss = loss_fn(ref, batch)
        ref_loss.backward()
        ref_optim.step()
        ref_optim.zero_grad()
        global_loss = mean_over(total)
        torch.testing.assert_close(
            global_loss,
            ref_loss.detach().float(),
            rtol=rtol,
            atol=atol,
            msg=_prefixed(f"step {step}, loss"),
        )
        losses.append(global_loss.item())
    return losses


class DataParallelReference:
    """One process doing what N data-parallel ranks do together.

    ``backward`` runs every rank's batch through the reference model and
    leaves the average gradient on it, which is what averaging gradients
    across ranks gives the sharded model. With ``param_dtype``, each rank's
    batch runs on a copy cast to that dtype and its gradients are cast back
    before averaging: the arithmetic of mixed precision with a full-precision
    reduction, reproduced in one process. Buffers keep their dtype, as mixed
    precision leaves them (Llama's rotary ``inv_freq`` must stay fp32).
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Sequence[torch.Tensor]], torch.Tensor],
        param_dtype: torch.dtype | None = None,
    ) -> None:
        self.model, self.loss_fn, self.param_dtype = model, loss_fn, param_dtype

    def backward(self, rank_batches: list[Sequence[torch.Tensor]], num_microbatches: int = 1) -> torch.Tensor:
        """Returns the loss averaged over ranks (and summed over micro-batches).

        In low precision, micro-batch gradients are summed in fp32, as the
        engine accumulates unsynced gradients in the reduce dtype.
        """
        num_ranks = len(rank_batches)
        total = torch.zeros(())
        summed: list[torch.Tensor | None] | None = None
        for batch in rank_batches:
            replica = low_precision_copy(self.model, self.param_dtype) if self.param_dtype else self.model
            for micro in zip(*(t.chunk(num_microbatches) for t in batch)):
                loss = self.loss_fn(replica, micro) / num_microbatches
                total += loss.detach().float()
                if not self.param_dtype:
                    (loss / num_ranks).backward()
                    continue
                loss.backward()
                grads = [p.grad.float() if p.grad is not None else None for p in replica.parameters()]
                replica.zero_grad()
                summed = (
                    grads
                    if summed is None
                    else [None if a is None or b is None else a + b for a, b in zip(summed, grads)]
                )
        if summed is not None:
            for param, grad in zip(self.model.parameters(), summed):
                param.grad = grad / num_ranks if grad is not None else None
        return total / num_ranks


def low_precision_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``model`` with its floating parameters (not buffers) cast to ``dtype``.

    ``model.to(dtype)`` would cast floating buffers too, which neither
    ``MixedPrecisionPolicy`` nor ``MixedPrecision`` without ``buffer_dtype`` does.
    """
    replica = copy.deepcopy(model)
    for param in replica.parameters():
        if param.is_floating_point():
            param.data = param.data.to(dtype)
    return replica
