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
import functools
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fullshard
from fullshard.testing import case, clone_tree, distributed, full_value

# make test only (about 20 s): torch's oracle on upstream behaviours whose paths the fast tier's parity tests take.
pytestmark = pytest.mark.slow

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
                # fp16 sums, in another order
                assert_same_run({lib: run[2] for lib, run in runs.items()}, atol=1e-5, rtol=1e-4)


# -- fully_shard helpers -----------------------------------------------------------------------------
def shard_layers(lib, model: MLP, **kwargs: Any) -> MLP:
    """Each layer and the head a unit, the root one too."""
    for layer in [*model.layers, model.head]:
        lib.fully_shard(layer, **kwargs)
    lib.fully_shard(model, **kwargs)
    return model


def reduce_scatter_dtypes_and_bytes(lib) -> contextlib.AbstractContextManager:
    """fullshard's collectives inside the block (nothing for torch)."""
    if lib.lib == "torch":
        return contextlib.nullcontext([])
    from fullshard._core import comm

    return comm.record_comms()


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


@contextlib.contextmanager
def reduction_dtypes(lib) -> Any:
    """The dtypes of the gradient reductions issued inside the block."""
    dtypes: set[torch.dtype] = set()
    with reductions(lib) as found:
        yield dtypes
    dtypes.update(dtype for _, dtype, _ in found)


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
            return train_dropping_an_output(model, optim, both_steps=3), full_params(model)

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


# -- test_fsdp_fine_tune.py test_parity_with_non_frozen_fsdp -----------------------------------------
class FrozenUnusedInput(nn.Module):
    """A middle unit that ignores its input (so nothing flows back through it)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.ignores_input = nn.Linear(8, 8)
        self.last = nn.Linear(8, 1)
        self.ignores_input.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.first(x))
        context = self.ignores_input(torch.ones_like(x))
        return self.last(hidden + context)


@distributed(world_size=2)
def test_frozen_unit_with_an_unused_input_matches_torch():
    """A frozen unit whose output does not depend on its input (resharded without a
    backward through it), flat or original parameters, fp16 mixed precision or
    none, either backward prefetch: torch's wrapper's losses and parameters."""
    for orig in (False, True):
        for half in (False, True):
            for prefetch in ("BACKWARD_PRE", "BACKWARD_POST"):

                def body(lib, orig=orig, half=half, prefetch=prefetch):
                    from torch.distributed.fsdp import BackwardPrefetch as TorchPrefetch

                    prefetch_enum = TorchPrefetch if lib.lib == "torch" else fullshard.BackwardPrefetch
                    mp = lib.MixedPrecision(param_dtype=torch.float16) if half else None
                    model = wrap_fsdp1(
                        lib,
                        FrozenUnusedInput(),
                        use_orig_params=orig,
                        mixed_precision=mp,
                        backward_prefetch=getattr(prefetch_enum, prefetch),
                    )
                    optim = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
                    return sgd_train(model, rank_batches(3, 4, 8), optim=optim), full_state(model)

                with case(f"orig={orig} fp16={half} {prefetch}"):
                    both(body)


# -- test_fsdp_freezing_weights.py test_freezing_weights ---------------------------------------------
class TrunkAndHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


@distributed(world_size=2)
def test_trunk_skipped_by_setting_its_grads_to_none_matches_torch():
    """The trunk's gradients set to ``None`` before each SGD-momentum step (the
    optimizer skips it), the trunk its own unit or inside the root's: torch's
    wrapper's losses and parameters exactly; the trunk does not move."""
    for nested, orig in ((True, False), (True, True), (False, True)):

        def body(lib, nested=nested, orig=orig):
            model = TrunkAndHead()
            initial = {k: v.clone() for k, v in model.trunk.state_dict().items()}
            classes = (nn.Sequential,) if nested else ()
            model = wrap_fsdp1(lib, model, classes=classes, use_orig_params=orig)
            optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            trunk = model.module.trunk
            losses = []
            for x in rank_batches(3, 4, 8):
                loss = model(x).sum()
                loss.backward()
                for p in trunk.parameters():
                    p.grad = None
                optim.step()
                optim.zero_grad()
                losses.append(loss.detach())
            state = full_state(model)
            for key, value in initial.items():
                torch.testing.assert_close(state[f"trunk.{key}"], value, atol=0, rtol=0)
            return losses, state

        with case(f"nested={nested} orig={orig}"):
            both(body)


# -- test_fsdp_mixed_precision.py test_mixed_precision_e2e_full_shard --------------------------------
class ScaledMLP(MLP):
    """An MLP with a buffer used in forward (cast by ``buffer_dtype``) and a parameter
    of the root's own (FSDP1 restores the original buffer dtype in a state dict only
    for a unit with parameters: docs/api.md, "Buffers of a wrapper unit with no
    parameter of its own")."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.shift = nn.Parameter(torch.full((8,), 0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * self.scale.to(x.dtype) + self.shift)


MP_CONFIGS = {
    "all": {"param_dtype": torch.float16, "reduce_dtype": torch.float16, "buffer_dtype": torch.float16},
    "param": {"param_dtype": torch.float16},
    "reduce": {"reduce_dtype": torch.float16},
    "buffer": {"buffer_dtype": torch.float16},
    "keep_low": {"param_dtype": torch.float16, "keep_low_precision_grads": True},
}


def record_forward_dtypes(model: nn.Module) -> list[str]:
    """Each ``Linear``'s input and weight dtypes, and the root's buffer's, in every forward."""
    seen: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(
                lambda m, args, name=name: seen.append(f"{name}:{args[0].dtype},{m.weight.dtype}")
            )
    model.register_forward_pre_hook(lambda m, args: seen.append(f"scale:{m.scale.dtype}"))
    return seen


@distributed(world_size=2)
def test_wrapper_mixed_precision_configs_match_torch():
    """Each ``MixedPrecision`` field alone, all together, and ``keep_low_precision_grads``,
    over fp32 and fp64 parameters, flat or original parameters, FULL_SHARD or
    SHARD_GRAD_OP, on 2 ranks or on a one-rank group: the dtypes of inputs,
    parameters and buffers in forward, the reduction dtypes and the gradient
    dtypes are torch's wrapper's, and so are the losses and parameters."""
    one_rank = [dist.new_group([0]), dist.new_group([1])][dist.get_rank()]
    combos = [  # (parameter dtype, strategy, group, use_orig_params)
        (torch.float32, "FULL_SHARD", None, False),
        (torch.float32, "FULL_SHARD", None, True),
        (torch.float32, "SHARD_GRAD_OP", None, True),
        (torch.float32, "FULL_SHARD", one_rank, False),
        (torch.float64, "SHARD_GRAD_OP", None, False),
    ]
    for label, config in MP_CONFIGS.items():
        for dtype, strategy, group, orig in combos:

            def body(lib, config=config, dtype=dtype, orig=orig, strategy=strategy, group=group):
                model = ScaledMLP().to(dtype)
                seen = record_forward_dtypes(model)
                model = wrap_fsdp1(
                    lib,
                    model,
                    mixed_precision=lib.MixedPrecision(**config),
                    use_orig_params=orig,
                    sharding_strategy=getattr(lib.ShardingStrategy, strategy),
                    process_group=group,
                )
                optim = torch.optim.SGD(model.parameters(), lr=0.1)
                losses, grads = [], set()
                with reduction_dtypes(lib) as reduced:
                    for x in rank_batches(2, 4, 8, dtype=dtype):
                        loss = model(x).sum()
                        loss.backward()
                        grads.update(d for d in grad_dtypes(model) if d is not None)
                        optim.step()
                        optim.zero_grad()
                        losses.append(loss.detach().to(dtype))
                # one rank: torch still calls a collective, we skip it
                reduced = sorted(map(str, reduced)) if group is None else []
                return losses, full_state(model), reduced, sorted(map(str, grads)), seen

            where = "one rank" if group is not None else "2 ranks"
            with case(f"{label} {dtype} orig={orig} {strategy} {where}"):
                runs = both(body)
                low = label == "keep_low"
                assert runs["fullshard"][3] == [str(torch.float16 if low else dtype)]
                assert runs["fullshard"][1]["scale"].dtype == dtype
    with case("a root with no parameter of its own"):  # the documented difference
        for lib in LIBS:
            model = ScaledMLP()
            del model.shift
            model.shift = torch.zeros(8)
            model = wrap_fsdp1(api(lib), model, mixed_precision=api(lib).MixedPrecision(buffer_dtype=torch.float16))
            expected = torch.float16 if lib == "torch" else torch.float32
            assert model.state_dict()["scale"].dtype == expected, lib


# -- test_fsdp_pure_fp16.py test_fp16_dtypes ---------------------------------------------------------
@distributed(world_size=2)
def test_half_model_reduce_dtype_inferred_from_param_dtype_matches_torch():
    """``.half()`` before or after wrapping, with no ``MixedPrecision`` or one with
    only ``param_dtype`` (fp16 or fp32): the parameter, gradient and reduction
    dtypes (the reduce dtype follows ``param_dtype``) and values are torch's:
    exactly with flat parameters; with ``use_orig_params=True`` the fp16 SGD
    update may round one element one ulp apart, as the shards' layouts differ
    (docs/api.md, "Layout under ``use_orig_params=True``") and CPU kernels round
    a tensor's vectorized body and its tail differently."""
    for orig in (False, True):
        for half_after in (False, True):
            for param_dtype in (None, torch.float16, torch.float32):

                def body(lib, orig=orig, half_after=half_after, param_dtype=param_dtype):
                    model = MLP() if half_after else MLP().half()
                    mp = None if param_dtype is None else lib.MixedPrecision(param_dtype=param_dtype)
                    model = wrap_fsdp1(lib, model, mixed_precision=mp, use_orig_params=orig)
                    if half_after:
                        model.half()
                    optim = torch.optim.SGD(model.parameters(), lr=0.1)
                    with reduction_dtypes(lib) as reduced:
                        x = rank_batches(1, 4, 8, dtype=torch.float16)[0]
                        loss = model(x).sum()
                        loss.backward()
                    params = sorted({str(p.dtype) for p in model.parameters()})
                    grads = sorted({str(d) for d in grad_dtypes(model) if d is not None})
                    if orig:
                        with lib.FSDP.summon_full_params(model, with_grads=True):
                            full_grads = [p.grad.clone() for p in model.parameters()]
                    else:  # the flat shards: one layout in both
                        full_grads = [p.grad.clone() for p in model.parameters()]
                    optim.step()
                    return [loss.detach()], full_grads, params, grads, sorted(map(str, reduced)), full_state(model)

                with case(f"orig={orig} half_after={half_after} param_dtype={param_dtype}"):
                    runs = {}
                    for lib in LIBS:
                        torch.manual_seed(0)
                        runs[lib] = body(api(lib))
                    assert_same_run({lib: run[:5] for lib, run in runs.items()})
                    assert_same_run({lib: run[5] for lib, run in runs.items()}, atol=0 if not orig else 1e-3)
                    assert runs["fullshard"][2] == runs["fullshard"][3] == ["torch.float16"]


# -- test_fully_shard_training.py / test_fully_shard_grad_acc.py: sync off on some units -------------
def sync_off_targets(model: MLP, mode: str) -> list[tuple[Any, bool]]:
    """(module, recurse) pairs whose gradient sync a mode turns off between syncs."""
    if mode == "all":
        return [(model, True)]
    if mode == "root_only":
        return [(model, False)]
    return [(model.layers[0], False), (model.head, False)]  # "some": two leaf units


@distributed(world_size=2)
def test_gradient_sync_off_on_some_units_matches_torch():
    """Three micro-batches per step with gradient sync off on every unit, on the root
    only (``recurse=False``) or on two units, the others reducing each
    micro-batch, resharding after backward or not until the last: torch's
    losses, parameters and reduce-scatter count and sizes."""
    for mode in ("all", "root_only", "some"):
        for reshard_between in (True, False):

            def body(lib, mode=mode, reshard_between=reshard_between):
                model = shard_layers(lib, MLP())
                optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
                batches = rank_batches(6, 2, 8)
                losses = []
                with reductions(lib) as reduced:
                    for step in range(2):
                        for micro in range(3):
                            last = micro == 2
                            for module, recurse in sync_off_targets(model, mode):
                                module.set_requires_gradient_sync(last, recurse=recurse)
                            if not reshard_between:
                                model.set_reshard_after_backward(last)
                            loss = model(batches[3 * step + micro]).sum()
                            loss.backward()
                            losses.append(loss.detach())
                        optim.step()
                        optim.zero_grad()
                return losses, full_params(model), sorted(numel for op, _, numel in reduced if op == "reduce_scatter")

            with case(f"{mode} reshard_between={reshard_between}"):
                both(body, atol=1e-6, rtol=1e-5)  # sums of micro-batches, maybe in another order


# -- test_fully_shard_training.py test_partial_group_forward_then_standalone / _grad_accum_chunked ---
class LossHead(nn.Module):
    """A trunk, a norm and an output layer; ``forward(tokens, project=False)`` stops
    before the output layer, which the loss then runs alone per chunk."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 8)
        self.block = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.output = nn.Linear(8, 7, bias=False)
        if tied:
            self.output.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, project: bool = True) -> torch.Tensor:
        hidden = self.norm(torch.relu(self.block(self.embed(tokens))))
        return self.output(hidden) if project else hidden

    def chunked_loss(self, tokens: torch.Tensor, num_chunks: int) -> torch.Tensor:
        """The output layer called alone on each chunk of the hidden states; one backward per chunk."""
        hidden = self(tokens, project=False)
        detached = hidden.detach().requires_grad_(True)
        total = torch.zeros(())
        for chunk in detached.chunk(num_chunks):
            loss = self.output(chunk).logsumexp(-1).sum()
            loss.backward()
            total += loss.detach()
        hidden.backward(detached.grad)
        return total


def shard_grouped(lib, model: LossHead, tied: bool) -> None:
    """The norm and the output layer one grouped unit (``fully_shard([...])``; the
    embedding too when tied to the output), the block its own."""
    lib.fully_shard(model.block)
    lib.fully_shard([model.embed, model.norm, model.output] if tied else [model.norm, model.output])
    lib.fully_shard(model)


@distributed(world_size=2)
def test_grouped_unit_module_run_alone_per_chunk_matches_torch():
    """The output layer of a grouped unit is skipped by the trunk's forward and then
    called alone on each loss chunk (one backward each), untied or tied to the
    embedding, with and without micro-batch accumulation (sync off until the
    last, ``set_is_last_backward``): torch's losses and parameters exactly."""
    for tied in (False, True):
        for accumulate in (False, True):

            def body(lib, tied=tied, accumulate=accumulate):
                model = LossHead(tied)
                shard_grouped(lib, model, tied)
                optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
                gen = torch.Generator().manual_seed(dist.get_rank() + 1)
                losses = []
                for _ in range(2):
                    num_micro = 2 if accumulate else 1
                    for micro in range(num_micro):
                        last = micro == num_micro - 1
                        model.set_requires_gradient_sync(last)
                        model.set_is_last_backward(last)
                        tokens = torch.randint(0, 7, (6,), generator=gen)
                        losses.append(model.chunked_loss(tokens, 3))
                    optim.step()
                    optim.zero_grad()
                return losses, full_params(model)

            with case(f"tied={tied} accumulate={accumulate}"):
                both(body, atol=1e-6 if accumulate else 0.0)  # micro-batch sums in another order


# -- test_fully_shard_training.py test_train_shared_params_uneven_shard ------------------------------
@distributed(world_size=2)
def test_tied_weight_with_an_uneven_shard_in_one_grouped_unit_matches_torch():
    """An embedding tied to the output layer, 7 rows on 2 ranks (the last shard
    padded), both in one grouped unit: torch's losses and parameters exactly, and
    every row (the padded shard's included) trains."""

    def body(lib):
        model = LossHead(tied=True)
        lib.fully_shard([model.embed, model.output])
        lib.fully_shard(model)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        before = full_params(model)["embed.weight"]
        gen = torch.Generator().manual_seed(dist.get_rank() + 1)
        losses = []
        for _ in range(3):
            tokens = torch.arange(7)[torch.randperm(7, generator=gen)]
            loss = model(tokens).logsumexp(-1).sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.detach())
        after = full_params(model)
        assert (after["embed.weight"] != before).any(dim=1).all(), "a row did not train"
        return losses, after

    both(body)


# -- test_fully_shard_compose.py test_replicate_and_fully_shard --------------------------------------
@distributed(world_size=2)
def test_replicate_root_over_fully_shard_children_matches_torch():
    """``replicate`` as the root over ``fully_shard`` children, and ``fully_shard`` as
    the root over ``replicate`` children, 5 Adam steps: torch's losses and
    parameters exactly."""
    from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate

    for root in ("replicate", "fully_shard"):

        def body(lib, root=root):
            replicate = torch_replicate if lib.lib == "torch" else fullshard.replicate
            model = MLP()
            inner, outer = (lib.fully_shard, replicate) if root == "replicate" else (replicate, lib.fully_shard)
            for layer in model.layers:
                inner(layer)
            outer(model)
            optim = torch.optim.Adam(model.parameters(), lr=1e-2)
            return sgd_train(model, rank_batches(5, 4, 8), optim=optim), full_params(model)

        with case(f"{root} root"):
            both(body)


# -- test_fully_shard_compose.py test_checkpoint_and_fully_shard -------------------------------------
@distributed(world_size=2)
def test_checkpointed_unit_sees_low_precision_inputs_on_recomputation_like_torch():
    """A child unit under activation checkpointing with an fp16 ``param_dtype``: the
    dtypes its modules see in forward and again in the recomputation are torch's
    (fp16 everywhere), and so are the losses and parameters."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.inner, x, use_reentrant=False)

    def body(lib):
        model = nn.Sequential(nn.Linear(8, 8), Checkpointed(), nn.Linear(8, 1))
        seen: list[str] = []
        hooks = [
            module.register_forward_pre_hook(lambda m, args, name=name: seen.append(f"{name}:{args[0].dtype}"))
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear)
        ]
        policy = lib.MixedPrecisionPolicy(param_dtype=torch.float16)
        lib.fully_shard(model[1], mp_policy=policy)
        lib.fully_shard(model, mp_policy=policy)
        try:
            losses = sgd_train(model, rank_batches(2, 4, 8))
        finally:
            for hook in hooks:
                hook.remove()
        return losses, full_params(model), seen

    runs = both(body)
    assert len(runs["fullshard"][2]) == 2 * 6  # 4 modules forward + 2 recomputed, per step
    assert all(entry.endswith("float16") for entry in runs["fullshard"][2])


# -- test_fully_shard_grad_scaler.py test_gradient_scaler (1-D) ---------------------------------------
@distributed(world_size=2)
def test_amp_grad_scaler_over_fully_shard_gradients_matches_torch():
    """``torch.amp.GradScaler`` (not ours) over ``fully_shard`` DTensor gradients: with
    an inf in one rank's input the inf is found on every rank, the step is
    skipped and the scale backs off; otherwise unscaling is exact and the step
    runs: torch's scales, gradients and parameters."""

    def body(lib):
        model = shard_layers(lib, MLP())
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        scales, grads, found_inf = [], [], []
        for step, x in enumerate(rank_batches(3, 4, 8)):
            if step == 1 and dist.get_rank() == 1:
                x = x.clone()
                x[0, 0] = float("inf")
            scaler.scale(model(x).sum()).backward()
            scaler.unscale_(optim)
            step_grads = [full_value(p.grad).clone() for p in model.parameters()]
            found_inf.append(not all(g.isfinite().all() for g in step_grads))
            if not found_inf[-1]:  # an inf's neighbours are nan or inf, in any order
                grads.append(step_grads)
            scaler.step(optim)
            scaler.update()
            optim.zero_grad()
            scales.append(scaler.get_scale())
        return scales, found_inf, grads, full_params(model)

    runs = both(body, atol=0, rtol=0)
    assert runs["fullshard"][1] == [False, True, False]
    scales = runs["fullshard"][0]
    assert scales[1] == scales[0] / 2 and scales[2] == scales[1], scales


# -- test_fsdp_mixed_precision.py TestFSDPDifferentSubmodulePrecision.test_float16_on_one_submodule -
class TwoChildren(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Linear(8, 8)
        self.c2 = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(torch.relu(self.c1(x)))


@distributed(world_size=2)
def test_fp16_child_wrapper_under_fp32_root_matches_torch():
    """A child wrapper with an fp16 ``param_dtype`` (casting its inputs) under an
    fp32 root: only the child's inputs are fp16, as in torch's wrapper, and the
    losses and parameters are torch's."""

    def body(lib):
        model = TwoChildren()
        seen: list[str] = []
        for name, module in (("root", model), ("c1", model.c1), ("c2", model.c2)):
            module.register_forward_pre_hook(lambda m, args, name=name: seen.append(f"{name}:{args[0].dtype}"))
        fp16 = lib.MixedPrecision(param_dtype=torch.float16, cast_forward_inputs=True)
        model.c2 = lib.FSDP(model.c2, mixed_precision=fp16, device_id=torch.device("cpu"))
        model = lib.FSDP(model, device_id=torch.device("cpu"))
        losses = sgd_train(model, rank_batches(2, 4, 8))
        return losses, full_state(model), seen

    runs = both(body)
    assert runs["fullshard"][2][:3] == ["root:torch.float32", "c1:torch.float32", "c2:torch.float16"]


# -- test_fsdp_mixed_precision.py TestFSDPTrainEval.test_train_ema_eval_flow -------------------------
@distributed(world_size=2)
def test_ema_copy_updated_in_summon_full_params_then_evaluated_matches_torch():
    """Train a wrapper under fp16 mixed precision, fold its full parameters into an
    EMA wrapper inside ``summon_full_params`` (writeback), evaluate the EMA
    wrapper: under FULL_SHARD and SHARD_GRAD_OP the eval outputs change every
    iteration (no stale gathered parameters) and equal torch's."""
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):

        def body(lib, strategy=strategy):
            kwargs = {
                "sharding_strategy": getattr(lib.ShardingStrategy, strategy),
                "mixed_precision": lib.MixedPrecision(param_dtype=torch.float16),
                "use_orig_params": True,
            }
            model = wrap_fsdp1(lib, MLP(), **kwargs)
            ema = wrap_fsdp1(lib, MLP(), **kwargs)
            optim = torch.optim.SGD(model.parameters(), lr=0.1)
            outputs = []
            probe = torch.ones(2, 8)
            for x in rank_batches(3, 4, 8):
                ema.train()
                sgd_train(model, [x], optim=optim)
                with lib.FSDP.summon_full_params(model), lib.FSDP.summon_full_params(ema, writeback=True):
                    with torch.no_grad():
                        for param, ema_param in zip(model.parameters(), ema.parameters()):
                            ema_param.mul_(0.5).add_(param, alpha=0.5)
                ema.eval()
                with torch.no_grad():
                    outputs.append(ema(probe).float())
            return outputs, full_state(ema)

        with case(strategy):
            runs = both(body)
            outputs = runs["fullshard"][0]
            assert all(not torch.equal(a, b) for a, b in zip(outputs, outputs[1:])), "a stale EMA output"


# -- test_fsdp_optim_state.py scatter_full_optim_state_dict, shard_full_optim_state_dict at half ------
def trained_wrapper(lib, group=None, tied: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    kwargs = {} if group is None else {"process_group": group}
    model = wrap_fsdp1(
        lib, Tied() if tied else MLP(), classes=() if tied else (nn.Linear,), use_orig_params=False, **kwargs
    )
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optim


@distributed(world_size=2)
def test_full_optim_state_dict_scattered_and_sharded_at_half_the_world_matches_torch():
    """A full optimizer state dict of a trained wrapper: ``scatter_full_optim_state_dict``
    from rank 0 gives each rank exactly its own optimizer state, and
    ``shard_full_optim_state_dict`` into a wrapper on a one-rank group (half the
    world) loads torch's states, which then train on as torch's. Our
    ``scatter_full_optim_state_dict`` into that group loads the same states
    (torch's fails there: it broadcasts from global rank 0, not in the group). An MLP
    and a model with tied weights."""
    halves = [dist.new_group([0]), dist.new_group([1])]
    half = halves[dist.get_rank()]

    def body(lib, load="shard", tied=False):
        model, optim = trained_wrapper(lib, tied=tied)
        sgd_train(model, rank_batches(2, 4, 8), optim=optim)
        full = lib.FSDP.full_optim_state_dict(model, optim, rank0_only=False)
        rank0_full = lib.FSDP.full_optim_state_dict(model, optim)
        torch.manual_seed(1)
        fresh, _ = trained_wrapper(lib, tied=tied)
        scattered = lib.FSDP.scatter_full_optim_state_dict(rank0_full if dist.get_rank() == 0 else None, fresh)
        assert_same(scattered["state"], optim.state_dict()["state"], 0.0, 0.0, "scattered")
        torch.manual_seed(1)
        small, small_optim = trained_wrapper(lib, half, tied)
        if load == "shard":
            sharded = lib.FSDP.shard_full_optim_state_dict(full, small)
        else:
            sharded = lib.FSDP.scatter_full_optim_state_dict(full, small, group=half)
        small_optim.load_state_dict(sharded)
        with lib.FSDP.summon_full_params(model), lib.FSDP.summon_full_params(small, writeback=True):
            with torch.no_grad():
                for param, small_param in zip(model.parameters(), small.parameters()):
                    small_param.copy_(param)
        loaded = small_optim.state_dict()["state"]
        return (
            scattered["state"],
            loaded,
            sgd_train(small, rank_batches(2, 4, 8, seed=5), optim=small_optim),
            full_state(small),
        )

    for tied in (False, True):
        with case(f"tied={tied}"):
            runs = both(functools.partial(body, tied=tied))
            torch.manual_seed(0)
            scattered = body(api("fullshard"), load="scatter", tied=tied)
            assert_same(scattered, runs["torch"], 0.0, 0.0, "scattered at half")


# -- test_fsdp_state_dict.py test_local_state_dict_with_empty_ranks ---------------------------------
def local_shards(value: Any) -> list[torch.Tensor]:
    """A local state dict value's local shards (a ShardedTensor holds none on a rank with only padding)."""
    if hasattr(value, "local_shards"):
        return [shard.tensor.clone() for shard in value.local_shards()]
    return [value.clone()]


class OneElement(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


@distributed(world_size=2)
def test_one_element_parameter_local_state_dict_and_writeback_match_torch():
    """A one-element parameter on 2 ranks (rank 1's shard is padding only): its local
    state dict loads into another wrapper (of other values), and
    ``summon_full_params(writeback=True)`` keeps only the owning rank's write
    (each rank writes its own value); torch's values throughout."""
    from torch.distributed.fsdp import StateDictType as TorchStateDictType

    def body(lib):
        state_dict_type = TorchStateDictType if lib.lib == "torch" else fullshard.StateDictType
        model = lib.FSDP(OneElement(), use_orig_params=False, device_id=torch.device("cpu"))
        other = OneElement()
        with torch.no_grad():
            other.scale.fill_(7.0)
        other = lib.FSDP(other, use_orig_params=False, device_id=torch.device("cpu"))
        results = []
        with lib.FSDP.state_dict_type(model, state_dict_type.LOCAL_STATE_DICT):
            local = model.state_dict()
            saved = {k: local_shards(v) for k, v in local.items()}
            with lib.FSDP.state_dict_type(other, state_dict_type.LOCAL_STATE_DICT):
                other.load_state_dict(local)
        model = other
        results += [saved, full_state(model)]
        with lib.FSDP.summon_full_params(model, writeback=True):
            with torch.no_grad():
                model.scale.fill_(10.0 + dist.get_rank())
        results.append(full_state(model))
        results.append(sgd_train(model, rank_batches(2, 4, 1)))
        results.append(full_state(model))
        return results

    runs = both(body)
    assert runs["fullshard"][1]["scale"].item() == 2.0
    assert runs["fullshard"][2]["scale"].item() == 10.0


# -- 2-D meshes (4 ranks) ----------------------------------------------------------------------------
def tp_mlp(mesh) -> nn.Module:
    """The column-then-row-parallel two-layer MLP of ``mesh["tp"]`` (seeded the same everywhere)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    return parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})


# -- test_fully_shard_state_dict.py test_2d_state_dict_correctness -----------------------------------
@distributed(world_size=4)
def test_2d_state_dict_full_values_match_the_local_model_and_torch():
    """Tensor parallel over "tp", ``fully_shard`` over "dp" of a (2, 2) mesh: every
    state-dict entry's full value is the local model's, before and after 3 Adam
    steps (the local model trained on every dp rank's batch), and equals torch's;
    loading it into a fresh 2-D model gives the same full values."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    ref_optim = torch.optim.Adam(ref.parameters(), lr=1e-2)
    dp_rank = mesh["dp"].get_local_rank()
    batches = [torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(r + 1)) for r in range(2)]
    for step in range(3):
        ref(torch.cat([batches[r][step] for r in range(2)])).sum().mul(0.5).backward()
        ref_optim.step()
        ref_optim.zero_grad()

    def body(lib):
        model = tp_mlp(mesh)
        lib.fully_shard(model[0], mesh=mesh["dp"])
        lib.fully_shard(model, mesh=mesh["dp"])
        initial = {k: full_value(v) for k, v in model.state_dict().items()}
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = sgd_train(model, list(batches[dp_rank]), optim=optim)
        trained = {k: full_value(v) for k, v in model.state_dict().items()}
        fresh = tp_mlp(mesh)
        lib.fully_shard(fresh[0], mesh=mesh["dp"])
        lib.fully_shard(fresh, mesh=mesh["dp"])
        fresh.load_state_dict(model.state_dict())
        loaded = {k: full_value(v) for k, v in fresh.state_dict().items()}
        return initial, losses, trained, loaded

    runs = both(body)
    torch.manual_seed(0)
    local = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).state_dict()
    initial, _, trained, loaded = runs["fullshard"]
    assert_same(initial, dict(local), 0.0, 0.0, "initial")
    assert_same(trained, dict(ref.state_dict()), 1e-6, 1e-5, "trained")  # the local model sums in another order
    assert_same(loaded, trained, 0.0, 0.0, "loaded")


# -- test_fully_shard_dtensor.py test_reduce_scatter_unused_dtensor_param ----------------------------
class ExpertParallel(nn.Module):
    """Each "ep" rank's local expert (a DTensor parameter sharded over "ep") used in
    forward, an idle DTensor parameter not used at all."""

    def __init__(self, ep_mesh) -> None:
        from torch.distributed.tensor import Shard, distribute_tensor

        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.experts = nn.Parameter(distribute_tensor(torch.randn(2, 8, 8) * 0.1, ep_mesh, [Shard(0)]))
        self.idle = nn.Parameter(distribute_tensor(torch.randn(2, 8, 8) * 0.1, ep_mesh, [Shard(0)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.shared(x)) @ self.experts.to_local()[0]


@distributed(world_size=4)
def test_unused_expert_parallel_dtensor_parameter_gets_a_zero_gradient_like_torch():
    """Experts sharded over "ep" of a (2, 2) mesh, ``fully_shard`` over "dp", one
    DTensor parameter unused in forward: with ``set_reduce_scatter_unused_params(True)``
    its gradient is a zero DTensor of its placements, the used ones equal torch's,
    and so are the parameters after 2 steps."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    dp_rank = mesh["dp"].get_local_rank()

    def body(lib):
        model = ExpertParallel(mesh["ep"])
        lib.fully_shard(model, mesh=mesh["dp"])
        model.set_reduce_scatter_unused_params(True)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(dp_rank + 1)
        grads = []
        for _ in range(2):
            model(torch.randn(4, 8, generator=gen)).sum().backward()
            grads.append({n: (p.grad.placements, full_value(p.grad)) for n, p in model.named_parameters()})
            optim.step()
            optim.zero_grad()
        return grads, full_params(model)

    runs = both(body)
    for placements, idle in (step["idle"] for step in runs["fullshard"][0]):
        assert not idle.any()
        assert placements == runs["fullshard"][0][0]["experts"][0]


# -- test_fsdp_tp_checkpoint_conversion.py test_fsdp_to_tp -------------------------------------------
@distributed(world_size=2)
def test_wrapper_sharded_checkpoint_loads_into_a_tensor_parallel_model_like_torch():
    """A wrapper's ``SHARDED_STATE_DICT`` (after a training step) saved with DCP and
    loaded into a tensor-parallel model of the same architecture: the TP model's
    full values are the wrapper's full parameters, and equal torch's; the TP
    model then computes the wrapper's outputs."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import StateDictType as TorchStateDictType

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    paths = [tempfile.mkdtemp(prefix="fullshard-fsdp-to-tp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(paths)

    def body(lib):
        state_dict_type = TorchStateDictType if lib.lib == "torch" else fullshard.StateDictType
        torch.manual_seed(0)
        model = wrap_fsdp1(lib, nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), use_orig_params=True)
        sgd_train(model, rank_batches(1, 4, 8))
        full = full_state(model)
        path = f"{paths[0]}/{lib.lib}"
        with lib.FSDP.state_dict_type(model, state_dict_type.SHARDED_STATE_DICT):
            dcp.save(model.state_dict(), checkpoint_id=path)
        tp = tp_mlp(mesh)
        state = tp.state_dict()
        dcp.load(state, checkpoint_id=path)
        tp.load_state_dict(state)
        loaded = {k: full_value(v) for k, v in tp.state_dict().items()}
        assert_same(loaded, full, 0.0, 0.0, "loaded into TP")
        probe = torch.ones(2, 8)
        with torch.no_grad():
            torch.testing.assert_close(tp(probe), model(probe), atol=1e-6, rtol=1e-5)
        return loaded

    try:
        both(body)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            import shutil

            shutil.rmtree(paths[0], ignore_errors=True)


# -- test_hsdp_sync_module_states.py test_hsdp_buffer_sync_from_meta_device --------------------------
class WithBuffer(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offset", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x + self.offset)


@distributed(world_size=4)
def test_hybrid_sync_module_states_from_a_meta_model_matches_torch():
    """``HYBRID_SHARD`` on a (2, 2) mesh with ``sync_module_states``: rank 0 builds the
    real model (its buffer set by hand), every other rank a meta one materialized
    empty by ``param_init_fn``; parameters and buffers become rank 0's on every
    rank, and training on equals torch's wrapper built from the real model on
    every rank (torch refuses ``sync_module_states`` with CPU tensors, so it
    cannot sync here itself)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def body(lib):
        torch.manual_seed(0)
        real = WithBuffer()
        real.offset.fill_(0.5)
        expected = {k: v.clone() for k, v in real.state_dict().items()}
        sync = lib.lib == "fullshard"
        model = real
        if sync and dist.get_rank() != 0:
            with torch.device("meta"):
                model = WithBuffer()
        kwargs = {"device_mesh": mesh, "sharding_strategy": lib.ShardingStrategy.HYBRID_SHARD}
        if sync:
            kwargs.update(
                sync_module_states=True,
                param_init_fn=lambda module: module.to_empty(device=torch.device("cpu"), recurse=False),
            )
        model = wrap_fsdp1(lib, model, **kwargs)
        synced = full_state(model)
        assert_same(synced, expected, 0.0, 0.0, "synced")
        return synced, sgd_train(model, rank_batches(2, 4, 8)), full_state(model)

    both(body)


# -- test_fsdp_multiple_wrapping.py test_multiple_wrapping -------------------------------------------
@distributed(world_size=2)
def test_wrapping_a_trained_model_again_matches_torch():
    """A model holding a nested wrapper, wrapped, trained 3 steps, then wrapped a
    second time (for inference): the new wrapper's output is the old one's, and
    both are torch's."""

    def body(lib):
        cpu = torch.device("cpu")
        inner = nn.Module()
        inner.layers = nn.Sequential(lib.FSDP(nn.Linear(5, 5), device_id=cpu))
        inner.forward = lambda x: inner.layers(x)
        model = lib.FSDP(inner, device_id=cpu)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        batches = rank_batches(4, 1, 5)
        sgd_train(model, batches[:3], optim=optim)
        with torch.no_grad():
            output = model(batches[3])
            rewrapped = lib.FSDP(inner, device_id=cpu)
            again = rewrapped(batches[3])
        torch.testing.assert_close(again, output, atol=0, rtol=0)
        return output, again

    both(body)


# -- test_fsdp_mixed_precision.py: casts, integer inputs, input gradients, full precision in eval ---
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


class Children(nn.Module):
    """c1 then c2 (c2 takes an extra input made inside forward); optionally casting
    c1's output back to fp32 before c2; every module's input dtypes recorded."""

    def __init__(self, cast_back: bool = False) -> None:
        super().__init__()
        self.c1 = nn.Linear(8, 8)
        self.c2 = nn.Linear(8, 8)
        self.cast_back = cast_back
        self.seen: list[str] = []
        for name, module in (("root", self), ("c1", self.c1), ("c2", self.c2)):
            module.register_forward_pre_hook(
                lambda m, args, name=name: self.seen.append(f"{name}:" + ",".join(str(a.dtype) for a in args))
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.c1(x)
        return self.c2(hidden.float() if self.cast_back else hidden)


def children_case(child: str, child_cast: bool, root_mp: bool, cast_back: bool) -> Callable:
    def body(lib):
        cpu = torch.device("cpu")
        model = Children(cast_back)
        fp16 = lib.MixedPrecision(param_dtype=torch.float16, cast_forward_inputs=child_cast)
        setattr(model, child, lib.FSDP(getattr(model, child), mixed_precision=fp16, device_id=cpu))
        root_policy = lib.MixedPrecision(param_dtype=torch.float32, cast_forward_inputs=True) if root_mp else None
        seen = model.seen
        model = lib.FSDP(model, mixed_precision=root_policy, device_id=cpu)
        losses = sgd_train(model, rank_batches(2, 4, 8))
        return losses, full_state(model), seen

    return body


class Embedded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 1)
        self.register_buffer("shift", torch.full((8,), 0.1))
        self.seen: list[str] = []
        self.embed.register_forward_pre_hook(lambda m, args: self.seen.append(str(args[0].dtype)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens) + self.shift.to(self.head.weight.dtype))


@distributed(world_size=2)
def test_wrapper_mixed_precision_casts_match_torch():
    """The wrapper's mixed-precision casts, case by case against torch's wrapper
    (the same input dtypes seen by each module, losses and parameters, or the
    same dtype-mismatch failure): an fp16 child casting its inputs or not, its
    parent casting back or not, under a root casting to fp32 or not, the child
    first or second; integer (embedding) inputs under reduce-only and
    param/buffer-only fp16; an fp32 input's gradient through an fp16 cast; an
    ignored fp32 module inside an fp16 wrapper (forward fails in both); a child's
    extra input made inside its parent's forward (not cast)."""
    cases = {
        "child casts": children_case("c2", True, False, False),
        "child skips, parent casts back": children_case("c2", False, False, True),
        "child skips, no cast back": children_case("c2", False, False, False),
        "fp16 child first under an fp32 root": children_case("c1", True, True, False),
        "fp16 child second under an fp32 root": children_case("c2", True, True, False),
    }
    for config in ({"reduce_dtype": torch.float16}, {"param_dtype": torch.float16, "buffer_dtype": torch.float16}):

        def embedding(lib, config=config):
            model = Embedded()
            seen = model.seen
            model = wrap_fsdp1(lib, model, classes=(nn.Embedding,), mixed_precision=lib.MixedPrecision(**config))
            gen = torch.Generator().manual_seed(dist.get_rank() + 1)
            batches = [torch.randint(0, 10, (4,), generator=gen) for _ in range(2)]
            return sgd_train(model, batches), full_state(model), seen

        cases[f"embedding {config}"] = embedding
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        for orig in (False, True):

            def input_grad(lib, strategy=strategy, orig=orig):
                mp = lib.MixedPrecision(param_dtype=torch.float16)
                strategy_enum = getattr(lib.ShardingStrategy, strategy)
                model = wrap_fsdp1(
                    lib, MLP(), mixed_precision=mp, sharding_strategy=strategy_enum, use_orig_params=orig
                )
                x = rank_batches(1, 4, 8)[0].requires_grad_(True)
                model(x).sum().backward()
                return x.grad.dtype == torch.float32, x.grad

            cases[f"input grad {strategy} orig={orig}"] = input_grad

    def ignored_module(lib):
        model = MLP()
        mp = lib.MixedPrecision(param_dtype=torch.float16)
        model = lib.FSDP(model, ignored_modules=[model.layers[1]], mixed_precision=mp, device_id=torch.device("cpu"))
        return sgd_train(model, rank_batches(1, 4, 8))

    cases["an fp32 ignored module inside an fp16 wrapper"] = ignored_module

    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + extra

    class External(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1 = nn.Linear(8, 8)
            self.c2 = TwoInputs()
            self.seen: list[str] = []
            self.c2.register_forward_pre_hook(lambda m, args: self.seen.append(",".join(str(a.dtype) for a in args)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c2(self.c1(x), torch.ones(x.shape[0], 8))  # the extra input: made here, fp32

    def external_input(lib):
        model = External()
        seen = model.seen
        model = wrap_fsdp1(
            lib, model, classes=(TwoInputs,), mixed_precision=lib.MixedPrecision(param_dtype=torch.float16)
        )
        return sgd_train(model, rank_batches(2, 4, 8)), full_state(model), seen

    cases["a child's input made inside the parent's forward"] = external_input
    for label, body in cases.items():
        with case(label):
            runs = both_outcomes(body)
            if label == "child casts":
                assert runs["fullshard"][1][2][:3] == ["root:torch.float32", "c1:torch.float32", "c2:torch.float16"]
            if label.startswith("embedding"):
                assert set(runs["fullshard"][1][2]) == {"torch.int64"}
            if label.startswith("input grad"):
                assert runs["fullshard"][1][0]
            if label in ("child skips, no cast back", "fp16 child first under an fp32 root"):
                assert runs["fullshard"] == ("raises", "RuntimeError", True), runs["fullshard"]
            if label == "fp16 child second under an fp32 root":
                assert runs["fullshard"][1][2][:3] == ["root:torch.float32", "c1:torch.float32", "c2:torch.float16"]
            if label.startswith("a child's input"):
                assert set(runs["fullshard"][1][2]) == {"torch.float16,torch.float32"}, runs["fullshard"][1][2]
            if label.startswith("an fp32 ignored"):
                assert runs["fullshard"] == ("raises", "RuntimeError", True)


@distributed(world_size=2)
def test_full_precision_in_eval_matches_torch():
    """``FSDP_USE_FULL_PREC_IN_EVAL=1`` (read when wrapping) or not, with fp16
    param, reduce and buffer dtypes: the input dtypes a parameterless root's
    children see in eval and in train, the buffer's dtype during and after an
    eval forward and after a train one, and the reduction dtype of a backward
    run in eval mode are torch's wrapper's, as are the outputs."""
    import os

    for full_precision in ("1", "0"):

        def body(lib):
            model = Children()
            model.register_buffer("scale", torch.full((8,), 0.5))
            model.register_forward_pre_hook(lambda m, args: m.seen.append(f"scale:{m.scale.dtype}"))
            seen = model.seen
            mp = lib.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16)
            model = wrap_fsdp1(lib, model, mixed_precision=mp)  # the root keeps only the buffer
            x = rank_batches(1, 4, 8)[0]
            model.eval()
            with reduction_dtypes(lib) as reduced:
                eval_out = model(x)
                eval_out.sum().backward()
            after_eval = model.module.scale.dtype
            model.train()
            train_out = model(x)
            train_out.sum().backward()
            return eval_out, train_out, seen, str(after_eval), str(model.module.scale.dtype), sorted(map(str, reduced))

        previous = os.environ.get("FSDP_USE_FULL_PREC_IN_EVAL")
        os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = full_precision
        try:
            with case(f"FSDP_USE_FULL_PREC_IN_EVAL={full_precision}"):
                both(body)
        finally:
            if previous is None:
                del os.environ["FSDP_USE_FULL_PREC_IN_EVAL"]
            else:
                os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = previous


# -- the wrapper's inputs, outputs and parameter views (test_fsdp_input.py, test_fsdp_misc.py, ...) -
class Pair(NamedTuple):
    left: torch.Tensor
    right: torch.Tensor


class Structured(nn.Module):
    """Takes a list, a dict or a namedtuple of two tensors; returns a namedtuple."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, inputs: Any) -> Pair:
        if isinstance(inputs, dict):
            left, right = inputs["left"], inputs["right"]
        else:
            left, right = inputs
        return Pair(self.lin(left), self.lin(right).relu())


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def structured_case(kind: str) -> Callable:
    def body(lib):
        model = wrap_fsdp1(lib, Structured())
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for left, right in zip(rank_batches(2, 4, 8), rank_batches(2, 4, 8, seed=9)):
            inputs = {"list": [left, right], "dict": {"left": left, "right": right}, "namedtuple": Pair(left, right)}
            out = model(inputs[kind])
            assert isinstance(out, Pair)
            loss = out.left.sum() + out.right.sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.detach())
        return losses, full_state(model)

    return body


def no_params(lib):
    """(Without ``device_id`` torch's wrapper needs an accelerator.)"""
    model = lib.FSDP(nn.Sequential(nn.ReLU(), nn.Tanh()), device_id=torch.device("cpu"))
    assert list(model.parameters()) == []
    return model(rank_batches(1, 4, 8)[0])


def tied_weights(lib):
    model = wrap_fsdp1(lib, Tied(), classes=())
    return sgd_train(model, rank_batches(3, 4, 8)), full_state(model)


def partly_wrapped_then_half(lib):
    model = MLP(num_layers=4)
    model.layers[1] = lib.FSDP(model.layers[1], device_id=torch.device("cpu"))
    model.layers[2] = lib.FSDP(model.layers[2], device_id=torch.device("cpu"))
    model = lib.FSDP(model, device_id=torch.device("cpu"))
    numels = [p.numel() for p in model.parameters()]
    model.to(torch.float16)
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    return numels, dtypes, sgd_train(model, rank_batches(2, 4, 8, dtype=torch.float16)), full_state(model)


def changed_after_wrapping(lib):
    model = wrap_fsdp1(lib, MLP())
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.5)
    return model(rank_batches(1, 4, 8)[0]), full_state(model)


def apply_on_tied(lib):
    model = wrap_fsdp1(lib, Tied(), classes=())

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            with torch.no_grad():
                module.weight.fill_(0.25)
                module.bias.fill_(-0.5)

    model.apply(init)
    return full_state(model), model(rank_batches(1, 4, 8)[0])


def outputs_leaving_the_loss(strategy: str) -> Callable:
    def body(lib):
        model = wrap_fsdp1(lib, TwoOutputs(), sharding_strategy=getattr(lib.ShardingStrategy, strategy))
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        return train_dropping_an_output(model, optim, both_steps=2), full_state(model)

    return body


@distributed(world_size=2)
def test_wrapper_inputs_outputs_and_parameter_views_match_torch():
    """The wrapper against torch's, case by case (losses, full parameters, outputs):
    list, dict and namedtuple inputs and a namedtuple output; a parameterless
    module; tied weights in one unit; a partly
    wrapped model's flat parameter sizes and ``.to(float16)``; an in-place change
    through ``parameters()`` right after wrapping; ``apply()`` on tied weights; an
    output leaving the loss after two steps under the three strategies."""
    cases: dict[str, Callable] = {kind: structured_case(kind) for kind in ("list", "dict", "namedtuple")}
    cases.update(
        {
            "no parameters": no_params,
            "tied weights": tied_weights,
            "partly wrapped, then half": partly_wrapped_then_half,
            "changed after wrapping": changed_after_wrapping,
            "apply on tied weights": apply_on_tied,
        }
    )
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        cases[f"output leaves the loss {strategy}"] = outputs_leaving_the_loss(strategy)
    for label, body in cases.items():
        with case(label):
            runs = both_outcomes(body)
            assert runs["fullshard"][0] == "returns", runs["fullshard"]


# -- fully_shard: container activations, post-accumulate-grad hooks, manual reshard ---------------
class ContainerBlock(nn.Module):
    """Takes and returns its activations in a ``kind`` container (list, tuple, namedtuple, dict)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(8, 8)

    def unpack(self, acts: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return (acts["a"], acts["b"]) if self.kind == "dict" else (acts[0], acts[1])

    def pack(self, a: torch.Tensor, b: torch.Tensor) -> Any:
        return {"list": [a, b], "tuple": (a, b), "namedtuple": Pair(a, b), "dict": {"a": a, "b": b}}[self.kind]

    def forward(self, acts: Any) -> Any:
        a, b = self.unpack(acts)
        return self.pack(torch.tanh(self.lin(a) + b), b * 0.5)


class ContainerModel(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ContainerBlock(kind) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acts = self.blocks[0].pack(x, x.flip(0))
        for block in self.blocks:
            acts = block(acts)
        a, b = self.blocks[0].unpack(acts)
        return a + b


@distributed(world_size=2)
def test_fully_shard_container_activations_hooks_and_manual_reshard_match_torch():
    """``fully_shard`` against torch's, case by case: activations passed between
    units in a list, tuple, namedtuple or dict; a post-accumulate-grad hook on
    every sharded parameter (runs once per parameter per backward) that steps a
    per-parameter optimizer (bit-identical to one optimizer step); a manual
    ``reshard()`` between forward and backward with ``reshard_after_forward=False``."""
    cases: dict[str, Callable] = {}
    for kind in ("list", "tuple", "namedtuple", "dict"):

        def containers(lib, kind=kind):
            model = ContainerModel(kind)
            for block in model.blocks:
                lib.fully_shard(block)
            lib.fully_shard(model)
            return sgd_train(model, rank_batches(3, 4, 8)), full_params(model)

        cases[f"{kind} activations"] = containers

    def optimizer_in_hook(lib):
        model = shard_layers(lib, MLP())
        calls: list[str] = []
        optims = {p: torch.optim.AdamW([p], lr=1e-2) for p in model.parameters()}
        names = {p: n for n, p in model.named_parameters()}

        def step(param: torch.Tensor) -> None:
            calls.append(names[param])
            optims[param].step()
            optims[param].zero_grad()

        handles = [p.register_post_accumulate_grad_hook(step) for p in model.parameters()]
        losses = []
        for x in rank_batches(3, 4, 8):
            loss = model(x).sum()
            loss.backward()
            losses.append(loss.detach())
        for handle in handles:
            handle.remove()
        assert sorted(calls) == sorted(3 * list(names.values())), calls
        return losses, full_params(model)

    def one_optimizer(lib):
        model = shard_layers(lib, MLP())
        return sgd_train(
            model, rank_batches(3, 4, 8), optim=torch.optim.AdamW(model.parameters(), lr=1e-2)
        ), full_params(model)

    def manual_reshard(lib):
        model = shard_layers(lib, MLP(), reshard_after_forward=False)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for x in rank_batches(3, 4, 8):
            loss = model(x).sum()
            for layer in model.layers:
                layer.reshard()
            with reduce_scatter_dtypes_and_bytes(lib) as records:
                loss.backward()
            if lib.lib == "fullshard":  # the resharded layers are gathered again (maybe bucketed) for backward
                gathered = sum(r.nbytes for r in records if r.op == "all_gather")
                assert gathered == len(model.layers) * (64 + 8) * 4, records
            optim.step()
            optim.zero_grad()
            losses.append(loss.detach())
        return losses, full_params(model)

    cases.update({"optimizer in hook": optimizer_in_hook, "manual reshard": manual_reshard})
    for label, body in cases.items():
        with case(label):
            runs = both_outcomes(body)
            assert runs["fullshard"][0] == "returns", runs["fullshard"]
    with case("optimizer in hook equals one optimizer"):
        torch.manual_seed(0)
        in_hook = optimizer_in_hook(api("fullshard"))
        torch.manual_seed(0)
        assert_same(in_hook, one_optimizer(api("fullshard")), 0.0, 0.0, "in hook")


# -- the wrapper with activation checkpointing, meta-device init, summons and optimizer states ------
def checkpoint_case(layout: str, orig: bool, strategy: str = "FULL_SHARD") -> Callable:
    """``layout``: "inside" FSDP(checkpoint_wrapper(layer)), "around" checkpoint_wrapper(FSDP(layer)),
    "whole" checkpoint_wrapper(FSDP(model)), "manual" torch.utils.checkpoint.checkpoint(fsdp_model, x),
    "submodule" (a submodule's forward calls checkpoint), "none"."""

    def body(lib):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        from torch.utils.checkpoint import checkpoint

        cpu = torch.device("cpu")
        kwargs = {
            "device_id": cpu,
            "use_orig_params": orig,
            "sharding_strategy": getattr(lib.ShardingStrategy, strategy),
        }
        model = CheckpointedMLP(checkpointed=layout == "submodule")
        if layout in ("inside", "around"):
            for index, layer in enumerate(model.layers):
                if layout == "inside":
                    model.layers[index] = lib.FSDP(checkpoint_wrapper(layer), **kwargs)
                else:
                    model.layers[index] = checkpoint_wrapper(lib.FSDP(layer, **kwargs))
        model = lib.FSDP(model, **kwargs)
        if layout == "whole":
            model = checkpoint_wrapper(model)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for x in rank_batches(3, 4, 8):
            out = checkpoint(model, x, use_reentrant=False) if layout == "manual" else model(x)
            loss = out.sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.detach())
        inner = model._checkpoint_wrapped_module if layout == "whole" else model
        return losses, full_state(inner)

    return body


def materialize(module: nn.Module) -> None:
    """A ``param_init_fn``: the module's own tensors made real and reset (where it can)."""
    module.to_empty(device=torch.device("cpu"), recurse=False)
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def meta_case(how: str) -> Callable:
    """A meta model built through ``enable_wrap``/``wrap`` (materialized by ``reset_parameters``
    or by ``param_init_fn``), or under mixed precision."""

    def body(lib):
        from torch.distributed.fsdp import wrap as torch_wrap

        from fullshard import wrap as our_wrap

        wrapping = torch_wrap if lib.lib == "torch" else our_wrap
        cpu = torch.device("cpu")
        init = {"param_init_fn": materialize} if how == "init_fn" else {}
        torch.manual_seed(0)
        with torch.device("meta"):
            model = MLP()
        if how == "mixed precision":
            mp = lib.MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float16)
            model = wrap_fsdp1(lib, model, mixed_precision=mp)
        else:
            with wrapping.enable_wrap(wrapper_cls=lib.FSDP, device_id=cpu, **init):
                for index, layer in enumerate(model.layers):
                    model.layers[index] = wrapping.wrap(layer)
                model = wrapping.wrap(model)
        torch.manual_seed(1)  # every rank materializes the same values
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, nn.Linear) and any(p.is_meta for p in module.parameters(recurse=False)):
                    module.to_empty(device=cpu, recurse=False)
                    module.reset_parameters()
        return sgd_train(model, rank_batches(2, 4, 8)), full_state(model)

    return body


def summon_cases(lib):
    """with_grads before any backward; summoning through a plain root over two wrappers."""
    cpu = torch.device("cpu")
    model = wrap_fsdp1(lib, MLP(), use_orig_params=True)
    with lib.FSDP.summon_full_params(model, with_grads=True):
        no_grads = [p.grad for p in model.parameters()]
    assert no_grads == [None] * len(no_grads)
    torch.manual_seed(0)
    plain = nn.ModuleDict({"a": lib.FSDP(MLP(), device_id=cpu), "b": lib.FSDP(MLP(), device_id=cpu)})
    with lib.FSDP.summon_full_params(plain):
        values = {n: (tuple(p.shape), str(p.dtype), p.detach().clone()) for n, p in plain.named_parameters()}
    return {clean(n): v for n, v in values.items()}


def optim_state_cases(lib):
    """The wrapper's optimizer state dict before any step; a layer frozen on alternate steps
    with the dict round-tripped (``optim_state_dict`` then ``optim_state_dict_to_load``). Flat
    parameters: with ``use_orig_params=True`` torch 2.13's dict on gloo holds ``exp_avg`` values
    that are not 0.1 x the summoned gradient after one Adam step (ours are); not chased here."""
    model = wrap_fsdp1(lib, MLP(), use_orig_params=False)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    empty = lib.FSDP.optim_state_dict(model, optim)
    results: list[Any] = [empty["state"], empty["param_groups"][0]["params"]]
    for step, x in enumerate(rank_batches(4, 4, 8)):
        model.module.layers[1].requires_grad_(step % 2 == 0)
        sgd_train(model, [x], optim=optim)
        saved = lib.FSDP.optim_state_dict(model, optim)
        optim.load_state_dict(lib.FSDP.optim_state_dict_to_load(model, optim, saved))
        results.append(clone_tree(saved["state"]))  # torch's "step" entries alias the optimizer's
    results.append(full_state(model))
    return results


@distributed(world_size=2)
def test_wrapper_checkpointing_meta_init_summons_and_optim_states_match_torch():
    """The wrapper against torch's, case by case (losses and full parameters, or
    the values seen): activation checkpointing inside and around each unit,
    around the whole wrapper, ``checkpoint(fsdp_model)``, and submodules calling
    ``checkpoint`` under NO_SHARD; meta-device models built through
    ``enable_wrap``/``wrap`` (with an init fn or materialized after), and under
    mixed precision; ``summon_full_params(with_grads=True)`` before any backward
    and through a plain root over two wrappers; optimizer state dicts before
    any step and round-tripped while a layer is frozen on alternate steps."""
    cases: dict[str, Callable] = {}
    for layout in ("none", "inside", "around", "whole", "manual"):
        for orig in (False, True):
            cases[f"checkpoint {layout} orig={orig}"] = checkpoint_case(layout, orig)
    cases["checkpoint submodule NO_SHARD"] = checkpoint_case("submodule", False, "NO_SHARD")
    for how in ("init_fn", "after", "mixed precision"):
        cases[f"meta {how}"] = meta_case(how)
    cases.update({"summons": summon_cases, "optimizer states": optim_state_cases})
    runs = {}
    for label, body in cases.items():
        with case(label):
            runs[label] = both_outcomes(body)
            assert runs[label]["fullshard"][0] == "returns", runs[label]["fullshard"]
    for label, run in runs.items():
        if label.startswith("checkpoint ") and "submodule" not in label:
            with case(f"{label} equals no checkpointing"):
                orig = label.endswith("True")
                assert_same(run["fullshard"], runs[f"checkpoint none orig={orig}"]["fullshard"], 0.0, 0.0, label)


# -- summon_full_params on one rank, names inside a summon, a summon between forwards ---------------
class WithNamedBuffer(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offset", torch.full((8,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x + self.offset)


@distributed(world_size=2)
def test_wrapper_summons_on_one_rank_names_and_between_forwards_match_torch():
    """The wrapper against torch's: on a one-rank group, a write inside
    ``summon_full_params`` with ``writeback=True`` (fp32 or fp16 parameters, flat
    or original) persists as in torch, with ``writeback=False`` it is discarded
    (torch keeps it there: a documented difference), and the summoned parameters through a plain
    root over two wrappers; inside a summon, ``named_parameters`` and
    ``named_buffers`` with ``prefix=`` and ``recurse=False``; a summon between two
    forwards of one iteration before its backward (losses and parameters)."""
    one_rank = [dist.new_group([0]), dist.new_group([1])][dist.get_rank()]
    cases: dict[str, Callable] = {}
    for writeback in (True, False):
        for dtype in (torch.float32, torch.float16):
            for orig in (False, True):
                for strategy in ("FULL_SHARD", "NO_SHARD"):

                    def one_rank_write(lib, writeback=writeback, dtype=dtype, orig=orig, strategy=strategy):
                        model = wrap_fsdp1(
                            lib,
                            MLP().to(dtype),
                            process_group=one_rank,
                            use_orig_params=orig,
                            sharding_strategy=getattr(lib.ShardingStrategy, strategy),
                        )
                        with lib.FSDP.summon_full_params(model, writeback=writeback):
                            with torch.no_grad():
                                for param in model.parameters():
                                    param.fill_(0.75)
                        return full_state(model)

                    cases[f"one rank writeback={writeback} {dtype} orig={orig} {strategy}"] = one_rank_write

    def one_rank_plain_root(lib):
        cpu = torch.device("cpu")
        plain = nn.ModuleDict(
            {k: lib.FSDP(MLP(), device_id=cpu, process_group=one_rank, use_orig_params=False) for k in "ab"}
        )
        with lib.FSDP.summon_full_params(plain):
            return {clean(n): (tuple(p.shape), str(p.dtype), p.detach().clone()) for n, p in plain.named_parameters()}

    def names_inside(lib):
        model = wrap_fsdp1(lib, WithNamedBuffer(), use_orig_params=True)
        with lib.FSDP.summon_full_params(model):
            return [
                [clean(n) for n, _ in model.named_parameters(prefix="top")],
                [clean(n) for n, _ in model.named_buffers(prefix="top")],
                [clean(n) for n, _ in model.named_parameters(recurse=False)],
                [clean(n) for n, _ in model.named_buffers(recurse=False)],
            ]

    def between_forwards(lib):
        model = wrap_fsdp1(lib, MLP(), use_orig_params=True)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for x, y in zip(rank_batches(2, 4, 8), rank_batches(2, 4, 8, seed=3)):
            first = model(x).sum()
            with lib.FSDP.summon_full_params(model):
                summed = sum(p.detach().sum() for p in model.parameters())
            loss = first + model(y).sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses += [loss.detach(), summed]
        return losses, full_state(model)

    cases.update(
        {"one rank plain root": one_rank_plain_root, "names": names_inside, "between forwards": between_forwards}
    )
    for label, body in cases.items():
        with case(label):
            if "writeback=False" in label:  # docs/api.md: torch keeps the write on one rank, we discard it
                for lib in LIBS:
                    torch.manual_seed(0)
                    values = body(api(lib))
                    assert bool((values["layers.0.weight"] == 0.75).all()) == (lib == "torch"), lib
                continue
            runs = both_outcomes(body)
            assert runs["fullshard"][0] == "returns", runs["fullshard"]


# -- test_fully_shard_mixed_precision.py test_submodules_with_external_inputs -----------------------
class ExtraInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + extra.to(x.dtype)


class MadeInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Linear(8, 8)
        self.c2 = ExtraInput()
        self.seen: list[str] = []
        self.c2.register_forward_pre_hook(lambda m, args: self.seen.append(",".join(str(a.dtype) for a in args)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(self.c1(x), torch.ones(x.shape[0], 8))  # made here, fp32


@distributed(world_size=2)
def test_fully_shard_child_input_made_inside_the_parent_matches_torch():
    """Under ``fully_shard`` with an fp16 ``param_dtype``, a child's extra input made
    inside its parent's forward is cast when the child casts its inputs and not
    when it does not (``cast_forward_inputs=False``): the dtypes the child sees,
    the losses and the parameters are torch's."""
    for child_casts in (True, False):

        def body(lib, child_casts=child_casts):
            model = MadeInside()
            seen = model.seen
            policy = lib.MixedPrecisionPolicy(param_dtype=torch.float16)
            child = lib.MixedPrecisionPolicy(param_dtype=torch.float16, cast_forward_inputs=child_casts)
            lib.fully_shard(model.c2, mp_policy=child)
            lib.fully_shard(model, mp_policy=policy)
            return sgd_train(model, rank_batches(2, 4, 8)), full_params(model), seen

        with case(f"child casts={child_casts}"):
            runs = both(body)
            expected = "torch.float16,torch.float16" if child_casts else "torch.float16,torch.float32"
            assert set(runs["fullshard"][2]) == {expected}, runs["fullshard"][2]


# -- test_fully_shard_comm.py test_backward_misprefetch; test_fully_shard_init.py container subclass --
class Layers(nn.ModuleDict):
    """A ``ModuleDict`` subclass with a forward of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.values():
            x = torch.relu(layer(x))
        return x


@distributed(world_size=2)
def test_fully_shard_misprefetch_and_container_subclass_match_torch():
    """``fully_shard`` against torch's: an explicit backward prefetch list that names
    the wrong units (the last layer prefetching the first) trains like torch's;
    a ``ModuleDict`` subclass with its own forward is sharded and trains as
    torch's."""

    def misprefetch(lib):
        model = shard_layers(lib, MLP(num_layers=4))
        model.layers[3].set_modules_to_backward_prefetch([model.layers[0]])
        model.head.set_modules_to_backward_prefetch([model.layers[1]])
        return sgd_train(model, rank_batches(3, 4, 8)), full_params(model)

    def container_subclass(lib):
        model = nn.Sequential(Layers({"a": nn.Linear(8, 8), "b": nn.Linear(8, 8)}), nn.Linear(8, 1))
        lib.fully_shard(model[0])
        lib.fully_shard(model)
        return sgd_train(model, rank_batches(3, 4, 8)), full_params(model)

    for label, body in (("misprefetch", misprefetch), ("ModuleDict subclass", container_subclass)):
        with case(label):
            both(body)


# -- test_fsdp_state_dict.py test_state_dict_type, test_state_dict_with_ignored_modules --------------
@distributed(world_size=2)
def test_state_dict_type_context_and_ignored_modules_match_torch():
    """The wrapper against torch's: ``state_dict_type`` sets the type inside the
    block and restores FULL_STATE_DICT on exit; a full state dict with an
    ignored module (``prefix=`` given) holds the ignored parameters uncloned (the
    same storage as the module's) and the buffers in their original dtype under
    buffer mixed precision (the same dtypes and values as torch's), and loads
    into a plain model."""
    from torch.distributed.fsdp import StateDictType as TorchStateDictType

    def body(lib):
        types_ = TorchStateDictType if lib.lib == "torch" else fullshard.StateDictType
        plain = WithNamedBuffer()
        ignored = plain.layers[1]
        mp = lib.MixedPrecision(buffer_dtype=torch.float16)
        model = lib.FSDP(plain, ignored_modules=[ignored], mixed_precision=mp, device_id=torch.device("cpu"))
        names = [lib.FSDP.get_state_dict_type(model).state_dict_type.name]
        with lib.FSDP.state_dict_type(model, types_.SHARDED_STATE_DICT):
            names.append(lib.FSDP.get_state_dict_type(model).state_dict_type.name)
        names.append(lib.FSDP.get_state_dict_type(model).state_dict_type.name)
        state = model.state_dict(prefix="top.")
        same_storage = [
            state["top.layers.1.weight"].data_ptr() == ignored.weight.data_ptr(),
            state["top.layers.1.bias"].data_ptr() == ignored.bias.data_ptr(),
        ]
        fresh = WithNamedBuffer()
        fresh.load_state_dict({k[len("top.") :]: v for k, v in state.items()})
        return names, same_storage, {k: (str(v.dtype), v.clone()) for k, v in state.items()}, full_params(fresh)

    runs = both(body)
    assert runs["fullshard"][0] == ["FULL_STATE_DICT", "SHARDED_STATE_DICT", "FULL_STATE_DICT"]
    assert runs["fullshard"][1] == [True, True]


# -- test_fsdp_ignored_modules.py: nested and auto-wrapped ignored states; test_fsdp_misc.py: meta --
@distributed(world_size=2)
def test_wrapper_ignored_states_match_torch():
    """The wrapper against torch's, case by case: ignoring a subtree that holds an
    already wrapped unit (its parameters stay out of the root's flat parameter,
    training matches); an ignored weight and bias inside an auto-wrapped unit
    (the flat parameters' sizes, training); a meta-device model with an ignored
    module, with and without ``param_init_fn`` (the ignored parameters stay on
    meta)."""
    cpu = torch.device("cpu")

    def nested(lib):
        model = MLP()
        model.layers[1] = nn.Sequential(lib.FSDP(model.layers[1], device_id=cpu, use_orig_params=False))
        model = lib.FSDP(model, ignored_modules=[model.layers[1]], device_id=cpu, use_orig_params=False)
        numels = [p.numel() for p in model.parameters()]
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        return numels, sgd_train(model, rank_batches(2, 4, 8), optim=optim)

    def auto_wrapped(lib):
        model = MLP()
        block = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        model.layers[1] = block
        ignored = [block[0].weight, block[1].bias]
        model = lib.FSDP(
            model,
            auto_wrap_policy=lib.ModuleWrapPolicy({nn.Sequential}),
            ignored_states=ignored,
            device_id=cpu,
            use_orig_params=False,
        )
        numels = [p.numel() for p in model.parameters()]
        return numels, sgd_train(model, rank_batches(2, 4, 8))

    def meta_ignored(lib, init_fn: bool = False):
        with torch.device("meta"):
            model = MLP()
        kwargs = {"param_init_fn": materialize} if init_fn else {}
        model = lib.FSDP(model, ignored_modules=[model.layers[1]], device_id=cpu, **kwargs)
        return [p.is_meta for p in model.module.layers[1].parameters()], [
            p.is_meta for n, p in model.named_parameters() if "layers.1." not in n
        ]

    cases = {
        "nested": nested,
        "auto-wrapped": auto_wrapped,
        "meta": meta_ignored,
        "meta with init fn": functools.partial(meta_ignored, init_fn=True),
    }
    for label, body in cases.items():
        with case(label):
            runs = both_outcomes(body)
            assert runs["fullshard"][0] == "returns", runs["fullshard"]
            if label.startswith("meta"):
                assert runs["fullshard"][1][0] == [True, True]


# -- test_wrap.py test_auto_wrap_with_ignored_modules ------------------------------------------------
@distributed(world_size=2)
def test_size_policy_leaves_ignored_parameters_out_of_its_count_like_torch():
    """``size_based_auto_wrap_policy`` with an ignored module: the ignored parameters
    do not count toward the threshold, so the same modules are wrapped as in
    torch's wrapper (a block reaching it only with the ignored layer is not)."""
    from torch.distributed.fsdp import wrap as torch_wrap

    from fullshard import wrap as our_wrap

    def body(lib):
        wrapping = torch_wrap if lib.lib == "torch" else our_wrap
        model = nn.Sequential(
            nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)),  # 144 parameters
            nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 16)),  # 72 + 144: over 150 only with the ignored layer
        )
        policy = functools.partial(wrapping.size_based_auto_wrap_policy, min_num_params=150)
        model = lib.FSDP(model, auto_wrap_policy=policy, ignored_modules=[model[1][1]], device_id=torch.device("cpu"))
        return sorted(clean(n) or "root" for n, m in model.named_modules() if isinstance(m, lib.FSDP))

    runs = both(body)
    assert runs["fullshard"] == ["root"], runs["fullshard"]
