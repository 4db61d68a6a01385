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


# -- fully_shard helpers -----------------------------------------------------------------------------
def shard_layers(lib, model: MLP, **kwargs: Any) -> MLP:
    """Each layer and the head a unit, the root one too."""
    for layer in [*model.layers, model.head]:
        lib.fully_shard(layer, **kwargs)
    lib.fully_shard(model, **kwargs)
    return model


def reduce_scatter_dtypes_and_bytes(lib) -> contextlib.AbstractContextManager:
    """fullshard's reduce-scatters inside the block (nothing for torch)."""
    if lib.lib == "torch":
        return contextlib.nullcontext([])
    from fullshard._core import comm

    return comm.record_comms()


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


# -- test_fully_shard_frozen.py test_train_mixed_requires_grad_per_group -----------------------------
@distributed(world_size=2)
def test_only_biases_trainable_in_each_unit_matches_torch():
    """Weights frozen and biases trainable in the same unit, frozen before or after
    sharding, with and without activation checkpointing and resharding after
    forward: torch's losses and parameters exactly, and fullshard reduce-scatters
    only the biases."""
    for freeze_after in (False, True):
        for checkpointed in (False, True):
            for reshard in (True, False):

                def body(lib, freeze_after=freeze_after, checkpointed=checkpointed, reshard=reshard):
                    model = CheckpointedMLP(checkpointed)
                    freeze = [p for n, p in model.named_parameters() if n.endswith("weight")]
                    if not freeze_after:
                        for p in freeze:
                            p.requires_grad_(False)
                    shard_layers(lib, model, reshard_after_forward=reshard)
                    if freeze_after:
                        for name, p in model.named_parameters():
                            if name.endswith("weight"):
                                p.requires_grad_(False)
                    with reduce_scatter_dtypes_and_bytes(lib) as records:
                        losses = sgd_train(model, rank_batches(3, 4, 8))
                    scattered = sum(r.nbytes for r in records if r.op == "reduce_scatter")
                    return losses, full_params(model), scattered

                with case(f"freeze_after={freeze_after} checkpointed={checkpointed} reshard={reshard}"):
                    runs = {}
                    for lib in LIBS:
                        torch.manual_seed(0)
                        runs[lib] = body(api(lib))
                    assert_same_run({lib: run[:2] for lib, run in runs.items()})
                    bias_numel = 3 * 8 + 2  # the head's 1-element bias padded to the 2 ranks
                    assert runs["fullshard"][2] == 3 * 4 * bias_numel, runs["fullshard"][2]


# -- test_fully_shard_frozen.py test_train_mixed_requires_grad_across_groups --------------------------
@distributed(world_size=2)
def test_units_frozen_then_unfrozen_between_steps_match_torch():
    """Alternate units frozen for two steps, a forward under ``no_grad``, then every
    unit unfrozen for the last steps: torch's losses and parameters exactly."""
    for reshard in (True, False):

        def body(lib, reshard=reshard):
            model = shard_layers(lib, MLP(num_layers=4), reshard_after_forward=reshard)
            optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            batches = rank_batches(5, 4, 8)
            for layer in model.layers[::2]:
                layer.requires_grad_(False)
            losses = sgd_train(model, batches[:2], optim=optim)
            with torch.no_grad():
                losses.append(model(batches[2]).sum())
            model.requires_grad_(True)
            losses += sgd_train(model, batches[3:], optim=optim)
            return losses, full_params(model)

        with case(f"reshard={reshard}"):
            both(body)


# -- test_fully_shard_autograd.py test_unused_forward_output -----------------------------------------
class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.left = nn.Linear(8, 8)
        self.right = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.relu(self.trunk(x))
        return self.left(hidden), self.right(hidden)


@distributed(world_size=2)
def test_output_dropping_out_of_the_loss_matches_torch():
    """Both outputs in the loss for three steps, then only one (the other unit's
    gradients stop): torch's losses and parameters exactly, resharding after
    forward or not."""
    for reshard in (True, False):

        def body(lib, reshard=reshard):
            model = TwoOutputs()
            for module in (model.trunk, model.left, model.right, model):
                lib.fully_shard(module, reshard_after_forward=reshard)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses = []
            for step, x in enumerate(rank_batches(6, 4, 8)):
                left, right = model(x)
                loss = left.sum() + right.sum() if step < 3 else left.sum()
                loss.backward()
                optim.step()
                optim.zero_grad()
                losses.append(loss.detach())
            return losses, full_params(model)

        with case(f"reshard={reshard}"):
            both(body)


# -- test_fully_shard_training.py test_non_root_forward_backward -------------------------------------
@distributed(world_size=2)
def test_child_unit_run_alone_after_root_steps_matches_torch():
    """Two root steps, then forward and backward through one child unit alone and a
    step, then the root again: torch's losses and parameters exactly."""
    for reshard in (True, False):

        def body(lib, reshard=reshard):
            model = shard_layers(lib, MLP(), reshard_after_forward=reshard)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
            batches = rank_batches(5, 4, 8)
            losses = sgd_train(model, batches[:2], optim=optim)
            loss = model.layers[1](batches[2]).sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.detach())
            losses += sgd_train(model, batches[3:], optim=optim)
            return losses, full_params(model)

        with case(f"reshard={reshard}"):
            both(body)


# -- test_fully_shard_training.py test_to_float64_after_init -----------------------------------------
@distributed(world_size=2)
def test_cast_to_float64_after_sharding_matches_torch():
    """``model.to(float64)`` after ``fully_shard``: parameters and gradients are fp64
    and training matches torch's exactly (with fp64 reduction)."""

    def body(lib):
        model = shard_layers(lib, MLP())
        model.to(torch.float64)
        assert {p.dtype for p in model.parameters()} == {torch.float64}
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with reduce_scatter_dtypes_and_bytes(lib) as records:
            losses = sgd_train(model, rank_batches(3, 4, 8, dtype=torch.float64), optim=optim)
        assert {r.dtype for r in records if r.op == "reduce_scatter"} <= {torch.float64}
        return losses, full_params(model)

    runs = both(body)
    assert {p.dtype for p in runs["fullshard"][1].values()} == {torch.float64}


# -- test_fully_shard_mixed_precision.py test_clamp_reduce_dtype -------------------------------------
@distributed(world_size=2)
def test_bf16_reduce_dtype_kept_after_casting_a_bf16_model_to_fp32_matches_torch():
    """A model built in bf16, sharded with bf16 param and reduce dtypes, then cast to
    fp32: the reduce-scatter still runs in bf16 (not clamped away), and training
    matches torch's exactly."""

    def body(lib):
        model = MLP().to(torch.bfloat16)
        policy = lib.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        shard_layers(lib, model, mp_policy=policy)
        model.to(torch.float32)
        with reduce_scatter_dtypes_and_bytes(lib) as records:
            losses = sgd_train(model, rank_batches(3, 4, 8))
        if lib.lib == "fullshard":
            assert {r.dtype for r in records if r.op == "reduce_scatter"} == {torch.bfloat16}
        return losses, full_params(model)

    runs = both(body)
    assert {p.dtype for p in runs["fullshard"][1].values()} == {torch.float32}
