"""What the upstream value tests (tests/test_upstream_values_*.py) share: torch's and
fullshard's FSDP names side by side, per-rank batches, and the comparison of one body run
with each library.

Each of those tests runs one body twice on the same gloo ranks, once with torch 2.13's FSDP
(``fully_shard`` or the FSDP1 wrapper, the oracle) and once with fullshard, from the same seed,
with the same optimizer and the same per-rank batches (seeded ``seed + rank + 1``), and asserts
equal losses and parameters (exact in fp32 unless a row says why not). Several cases share one
spawn and are named by ``case``.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

import fullshard
from fullshard.testing import case, full_value

LIBS = ("torch", "fullshard")


def api(lib: str) -> types.SimpleNamespace:
    """The FSDP names of ``lib`` that these tests use."""
    if lib == "torch":
        import torch.distributed.fsdp as names
        from torch.distributed.fsdp import wrap
    else:
        names = fullshard
        from fullshard import wrap
    return types.SimpleNamespace(
        lib=lib,
        fully_shard=names.fully_shard,
        MixedPrecisionPolicy=names.MixedPrecisionPolicy,
        FSDP=names.FullyShardedDataParallel,
        MixedPrecision=names.MixedPrecision,
        ShardingStrategy=names.ShardingStrategy,
        CPUOffload=names.CPUOffload,
        ModuleWrapPolicy=wrap.ModuleWrapPolicy,
    )


def train_dropping_an_output(model: nn.Module, optim: torch.optim.Optimizer, both_steps: int) -> list[torch.Tensor]:
    """Six steps of a two-output model whose right output leaves the loss after ``both_steps``."""
    losses = []
    for step, x in enumerate(rank_batches(6, 4, 8)):
        left, right = model(x)
        loss = left.sum() + right.sum() if step < both_steps else left.sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return losses


def rank_batches(num: int, *shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """``num`` batches of this rank's own (seeded ``seed + rank + 1``)."""
    gen = torch.Generator().manual_seed(seed + dist.get_rank() + 1)
    return [torch.randn(*shape, generator=gen).to(dtype) for _ in range(num)]


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded parameter values by name (the wrappers' prefixes removed)."""
    return {clean(name): full_value(param).detach().clone() for name, param in model.named_parameters()}


def clean(name: str) -> str:
    for prefix in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(prefix, "")
    return name


def assert_same_run(runs: dict[str, Any], atol: float = 0.0, rtol: float = 0.0) -> None:
    """torch's and fullshard's results equal: nested lists/tuples/dicts of tensors
    and floats compared by ``assert_close``, anything else (dtype names) by ``==``."""
    assert_same(runs["fullshard"], runs["torch"], atol, rtol, "result")


def assert_same(ours: Any, theirs: Any, atol: float, rtol: float, where: str) -> None:
    if isinstance(ours, (list, tuple)) and not isinstance(ours, str):
        assert isinstance(theirs, (list, tuple)) and len(ours) == len(theirs), f"{where}: {ours} vs {theirs}"
        for index, (a, b) in enumerate(zip(ours, theirs)):
            assert_same(a, b, atol, rtol, f"{where}[{index}]")
    elif isinstance(ours, dict):
        assert isinstance(theirs, dict) and ours.keys() == theirs.keys(), f"{where}: keys differ"
        for key in ours:
            assert_same(ours[key], theirs[key], atol, rtol, f"{where}[{key!r}]")
    elif isinstance(ours, (torch.Tensor, float)):
        torch.testing.assert_close(ours, theirs, atol=atol, rtol=rtol, msg=lambda m: f"{where}: {m}")
    else:
        assert ours == theirs, f"{where}: fullshard {ours} vs torch {theirs}"


def both(body: Callable[[types.SimpleNamespace], Any], atol: float = 0.0, rtol: float = 0.0) -> dict[str, Any]:
    """``body(api(lib))`` for each library from the same seed; asserts equal results."""
    runs = {}
    for lib in LIBS:
        with case(lib):
            torch.manual_seed(0)
            runs[lib] = body(api(lib))
    assert_same_run(runs, atol=atol, rtol=rtol)
    return runs


class MLP(nn.Module):
    def __init__(self, dim: int = 8, num_layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(dim, dim) for _ in range(num_layers)])
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def sgd_train(model: nn.Module, batches: list[torch.Tensor], lr: float = 0.1, optim=None) -> list[torch.Tensor]:
    """One step per batch (loss: the output's sum); the losses."""
    optim = optim or torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x in batches:
        loss = model(x).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach().float())
    return losses


def wrap_fsdp1(lib, model: nn.Module, classes=(nn.Linear,), **kwargs: Any) -> nn.Module:
    kwargs.setdefault("device_id", torch.device("cpu"))
    return lib.FSDP(model, auto_wrap_policy=lib.ModuleWrapPolicy(set(classes)), **kwargs)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A wrapper's full state dict (every rank), cloned, names cleaned."""
    return {clean(k): v.detach().clone() for k, v in model.state_dict().items()}


@contextlib.contextmanager
def reductions(lib) -> Any:
    """The gradient reductions issued inside the block, as ``(op, dtype, input
    numel)``: fullshard's through its spy, torch's by wrapping the two
    ``torch.distributed`` functions its FSDP calls (restored on exit)."""
    found: list[tuple[str, torch.dtype, int]] = []
    if lib.lib == "fullshard":
        from fullshard._core import comm

        with comm.record_comms() as records:
            yield found
        found += [
            (r.op, r.dtype, r.nbytes // r.dtype.itemsize) for r in records if r.op in ("reduce_scatter", "all_reduce")
        ]
        return
    originals = {"reduce_scatter": dist.reduce_scatter_single, "all_reduce": dist.all_reduce}

    def reduce_scatter(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        found.append(("reduce_scatter", input.dtype, input.numel()))
        return originals["reduce_scatter"](output, input, *args, **kwargs)

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        found.append(("all_reduce", tensor.dtype, tensor.numel()))
        return originals["all_reduce"](tensor, *args, **kwargs)

    try:
        dist.reduce_scatter_single, dist.all_reduce = reduce_scatter, all_reduce
        yield found
    finally:
        dist.reduce_scatter_single, dist.all_reduce = originals["reduce_scatter"], originals["all_reduce"]


class CheckpointedMLP(MLP):
    """An MLP whose layers run under activation checkpointing when ``checkpointed``."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for layer in self.layers:
            if self.checkpointed:
                x = checkpoint(lambda t, layer=layer: torch.relu(layer(t)), x, use_reentrant=False)
            else:
                x = torch.relu(layer(x))
        return self.head(x)


class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.left = nn.Linear(8, 8)
        self.right = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.relu(self.trunk(x))
        return self.left(hidden), self.right(hidden)


def outcome(body: Callable[[types.SimpleNamespace], Any], lib: types.SimpleNamespace) -> Any:
    """``body(lib)``'s result, or the name of the exception type it raised (forward
    failing with a dtype mismatch is the behaviour some rows assert)."""
    try:
        return "returns", body(lib)
    except RuntimeError as error:
        return "raises", type(error).__name__, "same dtype" in str(error) or "dtype" in str(error)


def both_outcomes(body: Callable[[types.SimpleNamespace], Any]) -> dict[str, Any]:
    runs = {}
    for lib in LIBS:
        with case(lib):
            torch.manual_seed(0)
            runs[lib] = outcome(body, api(lib))
    assert_same_run(runs)
    return runs


class Pair(NamedTuple):
    left: torch.Tensor
    right: torch.Tensor


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


class WithNamedBuffer(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offset", torch.full((8,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x + self.offset)
