"""Value gaps from tests/UPSTREAM.md's work queue, closed against torch's FSDP.

Each test runs one body twice on the same 2 gloo ranks, once with torch 2.13's
FSDP (``fully_shard`` or the FSDP1 wrapper, the oracle) and once with
fullshard, from the same seed, with the same optimizer and the same per-rank
batches (seeded ``seed + rank + 1``), and asserts equal losses and parameters
(exact in fp32 unless a row says why not). Several cases share one spawn and
are named by ``case``.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import fullshard
from fullshard.testing import case, distributed, full_value

LIBS = ("torch", "fullshard")


def api(lib: str) -> types.SimpleNamespace:
    """The FSDP names of ``lib`` that these tests use."""
    if lib == "torch":
        import torch.distributed.fsdp as fsdp
        from torch.distributed.fsdp import wrap

        return types.SimpleNamespace(
            lib=lib,
            fully_shard=fsdp.fully_shard,
            MixedPrecisionPolicy=fsdp.MixedPrecisionPolicy,
            FSDP=fsdp.FullyShardedDataParallel,
            MixedPrecision=fsdp.MixedPrecision,
            ShardingStrategy=fsdp.ShardingStrategy,
            CPUOffload=fsdp.CPUOffload,
            ModuleWrapPolicy=wrap.ModuleWrapPolicy,
        )
    from fullshard import wrap

    return types.SimpleNamespace(
        lib=lib,
        fully_shard=fullshard.fully_shard,
        MixedPrecisionPolicy=fullshard.MixedPrecisionPolicy,
        FSDP=fullshard.FullyShardedDataParallel,
        MixedPrecision=fullshard.MixedPrecision,
        ShardingStrategy=fullshard.ShardingStrategy,
        CPUOffload=fullshard.CPUOffload,
        ModuleWrapPolicy=wrap.ModuleWrapPolicy,
    )


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
    """torch's and fullshard's results (nested lists/dicts of tensors and floats) equal."""
    torch.testing.assert_close(runs["fullshard"], runs["torch"], atol=atol, rtol=rtol)


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


# -- test_fully_shard_mixed_precision.py test_compute_dtype ----------------------------------------
@distributed(world_size=2)
def test_low_precision_reduction_without_reduce_dtype_matches_torch():
    """bf16 parameters and no ``reduce_dtype``: gradients are reduced in bf16, with
    the default divide factor and with ``set_gradient_divide_factor``, the
    parameters kept in fp32; torch's values exactly."""
    for dtype in (torch.bfloat16, torch.float16):
        for factor in (None, 4.0, 1.0):

            def body(lib, dtype=dtype, factor=factor):
                model = MLP()
                policy = lib.MixedPrecisionPolicy(param_dtype=dtype)
                for layer in model.layers:
                    lib.fully_shard(layer, mp_policy=policy)
                lib.fully_shard(model, mp_policy=policy)
                if factor is not None:  # gloo has no PREMUL_SUM: torch needs summing comms
                    model.set_gradient_divide_factor(factor)
                    model.set_force_sum_reduction_for_comms(True)
                losses = sgd_train(model, rank_batches(3, 4, 8))
                grads_dtype = {p.grad for p in model.parameters()}
                assert grads_dtype == {None}
                return losses, full_params(model)

            with case(f"{dtype} factor {factor}"):
                both(body)


# -- FSDP1 wrapper helpers ---------------------------------------------------------------------------
def wrap_fsdp1(lib, model: nn.Module, classes=(nn.Linear,), **kwargs: Any) -> nn.Module:
    kwargs.setdefault("device_id", torch.device("cpu"))
    return lib.FSDP(model, auto_wrap_policy=lib.ModuleWrapPolicy(set(classes)), **kwargs)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A wrapper's full state dict (every rank), cloned, names cleaned."""
    return {clean(k): v.detach().clone() for k, v in model.state_dict().items()}


def grad_dtypes(model: nn.Module) -> list[Any]:
    return [None if p.grad is None else p.grad.dtype for p in model.parameters()]


# -- test_fsdp_grad_acc.py test_grad_acc -------------------------------------------------------------
@distributed(world_size=2)
def test_synced_and_no_sync_micro_batches_interleaved_match_torch():
    """Micro-batches alternating between synced backwards and ``no_sync`` ones (in
    either order, three strategies, flat or original parameters) accumulate like
    torch's wrapper; one step per sequence. (torch's wrapper cannot offload
    without an accelerator: it pins memory.)"""
    sequences = {"nosync-sync-nosync-sync": (True, False, True, False), "sync-nosync-sync": (False, True, False)}
    for label, sequence in sequences.items():
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
            for orig in (False, True):

                def body(lib, sequence=sequence, strategy=strategy, orig=orig):
                    model = wrap_fsdp1(
                        lib,
                        MLP(),
                        sharding_strategy=getattr(lib.ShardingStrategy, strategy),
                        use_orig_params=orig,
                    )
                    optim = torch.optim.SGD(model.parameters(), lr=0.1)
                    batches = rank_batches(2 * len(sequence), 2, 8)
                    losses = []
                    for step in range(2):
                        for index, no_sync in enumerate(sequence):
                            ctx = model.no_sync() if no_sync else contextlib.nullcontext()
                            with ctx:
                                loss = model(batches[step * len(sequence) + index]).sum()
                                loss.backward()
                            losses.append(loss.detach())
                        optim.step()
                        optim.zero_grad()
                    return losses, full_state(model)

                with case(f"{label} {strategy} orig={orig}"):
                    both(body, atol=1e-6, rtol=1e-5)  # the sums' order differs


# -- test_fsdp_use_orig_params.py test_no_sync_mixed_precision ---------------------------------------
@distributed(world_size=2)
def test_no_sync_gradient_dtype_under_mixed_precision_matches_torch():
    """Under mixed precision, after a ``no_sync`` backward and then a synced one, the
    wrapper's gradients are fp32 and equal torch's, as the parameters after the
    step. Inside ``no_sync`` torch shows the low-precision unsharded gradient on
    ``.grad`` and fullshard keeps it inside the unit (docs/api.md, "Under
    ``no_sync()``")."""
    for orig in (True, False):
        for reduce_dtype in (torch.float16, torch.float32):

            def body(lib, orig=orig, reduce_dtype=reduce_dtype):
                mp = lib.MixedPrecision(param_dtype=torch.float16, reduce_dtype=reduce_dtype)
                model = wrap_fsdp1(lib, MLP(), mixed_precision=mp, use_orig_params=orig)
                optim = torch.optim.SGD(model.parameters(), lr=0.1)
                x, y = rank_batches(2, 2, 8)
                with model.no_sync():
                    model(x).sum().backward()
                inside = set(grad_dtypes(model))
                model(y).sum().backward()
                after = {dtype for dtype in grad_dtypes(model) if dtype is not None}  # torch: None on empty shards
                optim.step()
                return inside, after, full_state(model)

            with case(f"orig={orig} reduce={reduce_dtype}"):
                runs = {}
                for lib in LIBS:
                    torch.manual_seed(0)
                    runs[lib] = body(api(lib))
                assert runs["torch"][0] == {torch.float16}
                assert runs["fullshard"][0] == {None}
                assert runs["fullshard"][1] == runs["torch"][1] == {torch.float32}
                assert_same_run({lib: run[2] for lib, run in runs.items()}, atol=1e-5, rtol=1e-4)  # fp16 sums, in another order
