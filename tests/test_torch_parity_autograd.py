"""Autograd paths against torch's FSDP: the same body runs on torch 2.13's
``fully_shard`` (or FSDP1 wrapper) and on fullshard, on 2 gloo ranks, and
both must match a local unsharded reference. Every rank feeds its own batch (seeded
``rank + 1``); the reference steps on the mean of every rank's loss, whose gradient the
reduction must average: a rank that skipped the reduce-scatter would train on its own batch only."""

import copy
import dataclasses
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp
import torch.nn as nn

import fullshard
from fullshard.testing import distributed, full_value

LIBS = ("torch", "fullshard")


def fully_shard_of(lib: str):
    if lib == "torch":
        from torch.distributed.fsdp import fully_shard

        return fully_shard
    return fullshard.fully_shard


def fsdp1_of(lib: str):
    """The FSDP1 wrapper class and ``ModuleWrapPolicy`` of ``lib``."""
    if lib == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel, ModuleWrapPolicy
    from fullshard.wrap import ModuleWrapPolicy

    return fullshard.FullyShardedDataParallel, ModuleWrapPolicy


# Losses as Python floats (compared in float64 by default): the ranks' mean is summed in another order
# than the reference's, about 1e-7 apart; one SGD step on a wrong gradient moves a loss by far more.
LOSS_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def rank_batches(*shape: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """This rank's batch and every rank's (rank r's seeded ``r + 1``)."""
    every = [torch.randn(*shape, generator=torch.Generator().manual_seed(r + 1)) for r in range(dist.get_world_size())]
    return every[dist.get_rank()], every


def train(
    model: nn.Module, x: torch.Tensor | list[torch.Tensor], steps: int = 3, loss_fn=None, optim=None
) -> list[float]:
    """SGD steps; returns the losses. ``x`` a list (every rank's batch, for the local reference):
    each step on the mean of their losses, returning this rank's loss."""
    optim = optim or torch.optim.SGD(model.parameters(), lr=0.1)
    every = x if isinstance(x, list) else [x]
    mine = dist.get_rank() if isinstance(x, list) else 0
    losses = []
    for _ in range(steps):
        per_batch = [loss_fn(model, b) if loss_fn is not None else model(b) for b in every]
        (sum(per_batch) / len(per_batch)).backward()
        optim.step()
        optim.zero_grad()
        losses.append(per_batch[mine].item())
    return losses


def assert_runs_like_reference(build, shard, steps: int = 3, loss_fn=None) -> None:
    """``build()`` made local, then sharded by ``shard(model, fully_shard)`` in both
    libraries: equal losses and parameters to the local model after ``steps``."""
    torch.manual_seed(0)
    ref = build()
    x, every = rank_batches(4, 8)
    ref_losses = train(ref, every, steps, loss_fn)
    for lib in LIBS:
        model = copy.deepcopy(build_seeded(build))
        shard(model, fully_shard_of(lib))
        losses = train(model, x, steps, loss_fn)
        torch.testing.assert_close(losses, ref_losses, **LOSS_TOLERANCE, msg=lambda m: f"{lib}: {m}")
        for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(full_value(param), ref_param.detach(), msg=lambda m: f"{lib} {name}: {m}")


def build_seeded(build):
    torch.manual_seed(0)
    return build()


# -- item 8a: activations passed between units inside a dataclass --------------------------------
@dataclasses.dataclass
class Activations:
    hidden: torch.Tensor


class DataclassBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, acts: Activations) -> Activations:
        return Activations(torch.tanh(self.lin(acts.hidden)))


class DataclassModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([DataclassBlock() for _ in range(3)])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acts = Activations(x)
        for block in self.blocks:
            acts = block(acts)
        return self.head(acts.hidden).sum()


# -- item 8b: one unit called several times (some calls without grad) next to a frozen unit --------
class RepeatedUse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(8, 8)
        self.shared = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            context = self.shared(x)
        hidden = self.frozen(self.shared(x) + context)
        hidden = self.frozen(self.shared(hidden))
        return self.head(hidden).sum()


# -- a unit whose frozen layer runs after its trainable one in backward -----------------------------
class FrozenBehindTrainable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.unit = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        self.unit[0].requires_grad_(False)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.unit(self.pre(x))).sum()


def shard_blocks(model: DataclassModel, fully_shard) -> None:
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


def shard_repeated(model: RepeatedUse, fully_shard) -> None:
    fully_shard(model.frozen)
    fully_shard(model.shared)
    fully_shard(model)


def shard_mixed_unit(model: FrozenBehindTrainable, fully_shard) -> None:
    fully_shard(model.unit)
    fully_shard(model)


@distributed(world_size=2)
def test_backward_keeps_parameters_every_use_needs():
    """Item 8: (a) dataclass activations, (b) repeated and no_grad uses beside a
    frozen unit, and a frozen layer behind a trainable one in one unit: no
    reads of resharded (freed) parameters, results as torch and the reference."""
    assert_runs_like_reference(DataclassModel, shard_blocks)
    assert_runs_like_reference(RepeatedUse, shard_repeated)
    assert_runs_like_reference(FrozenBehindTrainable, shard_mixed_unit)


# -- item 9: two forwards before one backward, nested units, composable checkpointing ------------
class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).softmax(-1) * x


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.attn = Attention()
        self.ff = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.ff(x)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum()


def shard_nested_checkpointed(model: Stack, fully_shard) -> None:
    from torch.distributed._composable import checkpoint

    for block in model.blocks:
        fully_shard(block.attn)
        fully_shard(block.ff)
        checkpoint(block)
        fully_shard(block)
    fully_shard(model)


def two_forwards(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The DPO pattern: two forwards (chosen, rejected), one loss, one backward."""
    return model(x) - 0.5 * model(2 * x)


@distributed(world_size=2)
def test_two_forwards_one_backward_with_checkpointed_nested_units():
    """Item 9: recomputation of a checkpointed block gathers the block's and the
    nested units' parameters and starts no new step."""
    assert_runs_like_reference(Stack, shard_nested_checkpointed, loss_fn=two_forwards)


# -- item 13: torch.func transforms through sharded units -----------------------------------------
def shard_blocks_of_stack(model: Stack, fully_shard) -> None:
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


@distributed(world_size=2)
def test_func_jvp_through_sharded_units():
    """Item 13: ``torch.func.jvp`` (forward-mode AD) through sharded units gives the
    reference's value and tangent, and training afterwards is unaffected."""
    torch.manual_seed(0)
    tangent = torch.randn(4, 8)
    x, every = rank_batches(4, 8)
    ref = build_seeded(Stack)
    expected = torch.func.jvp(ref, (x,), (tangent,))
    ref_losses = train(ref, every)
    for lib in LIBS:
        model = build_seeded(Stack)
        shard_blocks_of_stack(model, fully_shard_of(lib))
        # Built first: the root keeps its full parameters registered until a backward.
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        value, derivative = torch.func.jvp(model, (x,), (tangent,))
        torch.testing.assert_close((value, derivative), expected, msg=lambda m: f"{lib}: {m}")
        torch.testing.assert_close(
            train(model, x, optim=optim), ref_losses, **LOSS_TOLERANCE, msg=lambda m: f"{lib}: {m}"
        )


# -- item 10: a dtype change after wrapping -------------------------------------------------------
@distributed(world_size=2)
def test_half_after_wrapping_trains_in_half():
    """Item 10: ``model.half()`` after wrapping changes the sharded parameters' dtype
    (as in torch, flat or original parameters, wrapper or fully_shard); training
    then runs in fp16 and matches an fp16 local model."""
    x, every = rank_batches(4, 8)
    x, every = x.half(), [b.half() for b in every]
    ref_losses = train(build_seeded(Stack).half(), every)
    for lib in LIBS:
        wrapper, policy = fsdp1_of(lib)
        models = [
            wrapper(
                build_seeded(Stack),
                auto_wrap_policy=policy({Block}),
                use_orig_params=orig,
                device_id=torch.device("cpu"),
            )
            for orig in (False, True)
        ]
        composable = build_seeded(Stack)
        shard_blocks_of_stack(composable, fully_shard_of(lib))
        for model in [*models, composable]:
            model.half()
            assert {p.dtype for p in model.parameters()} == {torch.float16}, lib
            torch.testing.assert_close(train(model, x), ref_losses, msg=lambda m: f"{lib}: {m}")


# -- item 1: freezing a flat-parameter unit after wrapping ---------------------------------------
def assert_full_params_equal(wrapper, model: nn.Module, ref: nn.Module, lib: str) -> None:
    with wrapper.summon_full_params(model):
        params = [p for n, p in model.named_parameters() if "flat_param" not in n]
        assert len(params) == len(list(ref.parameters())), lib
        for param, ref_param in zip(params, ref.parameters()):
            torch.testing.assert_close(param.detach(), ref_param.detach(), msg=lambda m: f"{lib}: {m}")


@distributed(world_size=2)
def test_freezing_a_wrapped_unit_after_wrapping():
    """Item 1: ``requires_grad_(False)`` through the wrapped model on a nested unit
    with a flat parameter freezes it, as torch's FSDP1 and DDP (frozen before
    construction: DDP cannot freeze after) do; unfreezing resumes training."""
    from torch.nn.parallel import DistributedDataParallel

    x, _ = rank_batches(4, 8)  # DDP averages the ranks' gradients: the reference
    ref = build_seeded(Stack)
    ref_losses = train(DistributedDataParallel(ref), x, steps=1)
    ref.blocks[0].requires_grad_(False)
    ref_losses += train(DistributedDataParallel(ref), x, steps=2)
    for lib in LIBS:
        wrapper, policy = fsdp1_of(lib)
        model = wrapper(
            build_seeded(Stack), auto_wrap_policy=policy({Block}), use_orig_params=False, device_id=torch.device("cpu")
        )
        before = train(model, x, steps=1)  # a step before freezing: the unsharded forms exist
        model.blocks[0].requires_grad_(False)
        torch.testing.assert_close(
            before + train(model, x, steps=2), ref_losses, **LOSS_TOLERANCE, msg=lambda m: f"{lib}: {m}"
        )
        assert_full_params_equal(wrapper, model, ref, lib)
        model.blocks[0].requires_grad_(True)
        train(model, x, steps=1)
        with wrapper.summon_full_params(model):
            changed = model.blocks[0].norm.weight.detach().ne(ref.blocks[0].norm.weight.detach()).any()
        assert changed, f"{lib}: the unfrozen unit did not train"


# -- item 2: optimizers applied in backward --------------------------------------------------------
@distributed(world_size=2)
def test_optimizer_in_backward_steps_after_reduction():
    """Item 2: ``_apply_optimizer_in_backward`` on the parameters the wrapper (torch's
    FSDP1 supports it with use_orig_params=True) or fully_shard exposes: each
    backward steps them with the reduced gradient and leaves ``.grad`` None."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    x, every = rank_batches(4, 8)
    ref = build_seeded(Stack)
    ref_losses = train(ref, every)
    models = {}
    for lib in LIBS:
        wrapper, policy = fsdp1_of(lib)
        models[lib, "wrapper"] = wrapper(
            build_seeded(Stack), auto_wrap_policy=policy({Block}), use_orig_params=True, device_id=torch.device("cpu")
        )
    models["fullshard", "fully_shard"] = build_seeded(Stack)
    shard_blocks_of_stack(models["fullshard", "fully_shard"], fullshard.fully_shard)
    for (lib, api), model in models.items():
        _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
        losses = []
        for _ in range(3):
            loss = model(x)
            loss.backward()
            losses.append(loss.item())
            assert all(p.grad is None for p in model.parameters()), f"{lib} {api}"
        torch.testing.assert_close(losses, ref_losses, **LOSS_TOLERANCE, msg=lambda m: f"{lib} {api}: {m}")


# -- misuse the wrapper rejects as torch's FSDP1 does (same exception type) -------------------------
def wrap_stack(lib: str, model: nn.Module | None = None, **kwargs):
    wrapper, policy = fsdp1_of(lib)
    model = model if model is not None else build_seeded(Stack)
    return wrapper, wrapper(model, auto_wrap_policy=policy({Block}), device_id=torch.device("cpu"), **kwargs)


def clip_on_inner_unit(lib: str) -> None:
    wrapper, model = wrap_stack(lib)
    model(torch.randn(4, 8)).backward()
    model.clip_grad_norm_(1.0)  # the root works
    model.blocks[0].clip_grad_norm_(1.0)


def no_sync_on_inner_unit(lib: str) -> None:
    wrapper, model = wrap_stack(lib)
    with model.no_sync():  # the root works
        model(torch.randn(4, 8)).backward()
    with model.blocks[0].no_sync():
        pass


def summon_during_forward(lib: str) -> None:
    wrapper, model = wrap_stack(lib)

    def summon(module, args):
        with wrapper.summon_full_params(model):
            pass

    model.blocks[1].register_forward_pre_hook(summon)
    model(torch.randn(4, 8))


def summon_during_backward(lib: str) -> None:
    wrapper, model = wrap_stack(lib)
    loss = model(torch.randn(4, 8))

    def summon(grad):
        with wrapper.summon_full_params(model):
            pass

    loss.register_hook(summon)
    loss.backward()


def summon_rank0_only_with_writeback(lib: str) -> None:
    wrapper, model = wrap_stack(lib)
    with wrapper.summon_full_params(model, rank0_only=True, writeback=True):
        pass


def apply_inside_summon(lib: str) -> None:
    wrapper, model = wrap_stack(lib)
    model.apply(lambda module: None)  # outside: fine
    with wrapper.summon_full_params(model):
        model.apply(lambda module: None)


def flat_unit_mixing_requires_grad(lib: str) -> None:
    model = build_seeded(Stack)
    model.blocks[0].norm.requires_grad_(False)
    wrap_stack(lib, model, use_orig_params=False)


MISUSE = [
    (clip_on_inner_unit, RuntimeError),
    (no_sync_on_inner_unit, RuntimeError),
    (summon_during_forward, AssertionError),
    (summon_during_backward, AssertionError),
    (summon_rank0_only_with_writeback, NotImplementedError),
    (apply_inside_summon, ValueError),
    (flat_unit_mixing_requires_grad, ValueError),
]


@pytest.mark.parametrize("case,error", MISUSE, ids=[case.__name__ for case, _ in MISUSE])
@distributed(world_size=2)
def test_misuse_raises_as_torch(case, error):
    """One misuse per case: torch's FSDP1 and ours raise the same exception type."""
    for lib in LIBS:
        with pytest.raises(error) as raised:
            case(lib)
        assert type(raised.value) is error, f"{lib}: {type(raised.value).__name__}: {raised.value}"


# -- torch 2.13 API: set_is_last_backward, FSDP_USE_FULL_PREC_IN_EVAL ------------------------------
@distributed(world_size=2)
def test_set_is_last_backward_for_micro_batches():
    """``set_is_last_backward(False)`` on all but the last micro-batch (gradient sync
    off, as recipes combine them, or on): the step's gradients and training match
    torch's fully_shard and the reference; the flag stays until set again."""
    x, every = rank_batches(8, 8)
    ref = build_seeded(Stack)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    results = {}
    for lib, sync_every_micro_batch in itertools.product(LIBS, (False, True)):
        model = build_seeded(Stack)
        shard_blocks_of_stack(model, fully_shard_of(lib))
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(2):
            for index, micro in enumerate(x.chunk(4)):
                last = index == 3
                model.set_is_last_backward(last)
                model.set_requires_gradient_sync(last or sync_every_micro_batch)
                loss = model(micro) / 4
                loss.backward()
                losses.append(loss.item())
            optim.step()
            optim.zero_grad()
        results[lib, sync_every_micro_batch] = losses, [full_value(p) for p in model.parameters()]
    ref_losses = []
    for _ in range(2):
        for micros in zip(*(b.chunk(4) for b in every)):  # micro-batch i of every rank
            per_rank = [ref(micro) / 4 for micro in micros]
            (sum(per_rank) / len(per_rank)).backward()
            ref_losses.append(per_rank[dist.get_rank()].item())
        ref_optim.step()
        ref_optim.zero_grad()
    for lib, (losses, params) in results.items():
        torch.testing.assert_close(losses, ref_losses, **LOSS_TOLERANCE, msg=lambda m: f"{lib}: {m}")
        torch.testing.assert_close(params, [p.detach() for p in ref.parameters()], msg=lambda m: f"{lib}: {m}")


@distributed(world_size=2)
def test_full_precision_in_eval_env():
    """``FSDP_USE_FULL_PREC_IN_EVAL=1`` (read when wrapping): with bf16 mixed precision
    the wrapper's eval-mode forward runs in fp32, equal to the fp32 model, as
    torch's FSDP1; train mode still computes in bf16, equal to torch's."""
    import os

    x, _ = rank_batches(4, 8)
    ref = build_seeded(Stack)
    with torch.no_grad():
        expected = ref(x)
    outputs = {}
    os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = "1"
    try:
        for lib in LIBS:
            wrapper, policy = fsdp1_of(lib)
            precision = (torch.distributed.fsdp.MixedPrecision if lib == "torch" else fullshard.MixedPrecision)(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
            model = wrapper(
                build_seeded(Stack),
                auto_wrap_policy=policy({Block}),
                mixed_precision=precision,
                device_id=torch.device("cpu"),
            )
            with torch.no_grad():
                model.eval()
                in_eval = model(x)
                model.train()
                in_train = model(x)
            outputs[lib] = in_train
            assert in_eval.dtype == torch.float32, lib
            torch.testing.assert_close(in_eval, expected, msg=lambda m: f"{lib} eval: {m}")
            assert in_train.dtype == torch.bfloat16, lib
    finally:
        del os.environ["FSDP_USE_FULL_PREC_IN_EVAL"]
    torch.testing.assert_close(outputs["fullshard"], outputs["torch"])


# -- found on the way: BACKWARD_POST prefetch issued by a reduction finished at the end of backward ----
class BlockWithUnusedLayer(Block):
    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(8, 8)  # never gets a gradient: the unit's reduction waits for the end


class StackWithUnusedLayers(Stack):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([BlockWithUnusedLayer() for _ in range(3)])


@distributed(world_size=2)
def test_backward_post_prefetch_at_end_of_backward_is_not_reused():
    """A unit with an unused parameter reduces at the end of backward; its
    BACKWARD_POST prefetch of the unit before it then gathers values the
    optimizer is about to change: the next forward must gather again.
    Losses as torch's FSDP1 and the reference."""
    x, every = rank_batches(4, 8)
    ref_losses = train(build_seeded(StackWithUnusedLayers), every)
    for lib in LIBS:
        wrapper, policy = fsdp1_of(lib)
        prefetch = (torch.distributed.fsdp if lib == "torch" else fullshard).BackwardPrefetch.BACKWARD_POST
        model = wrapper(
            build_seeded(StackWithUnusedLayers),
            auto_wrap_policy=policy({BlockWithUnusedLayer}),
            backward_prefetch=prefetch,
            use_orig_params=True,
            device_id=torch.device("cpu"),
        )
        torch.testing.assert_close(train(model, x), ref_losses, **LOSS_TOLERANCE, msg=lambda m: f"{lib}: {m}")
