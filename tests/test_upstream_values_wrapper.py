"""Value gaps from tests/UPSTREAM.md's work queue: the FSDP1 wrapper (``FullyShardedDataParallel``).

Each is closed against torch's FSDP as the oracle: one body runs with each library
(tests/upstream_oracle.py says how).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from upstream_oracle import (
    LIBS,
    MLP,
    CheckpointedMLP,
    Pair,
    Tied,
    TwoOutputs,
    WithNamedBuffer,
    api,
    assert_same,
    assert_same_run,
    both,
    both_outcomes,
    clean,
    full_state,
    rank_batches,
    reductions,
    sgd_train,
    train_dropping_an_output,
    wrap_fsdp1,
)

import fullshard
from fullshard.testing import case, clone_tree, distributed

# Out of the inner loop: torch's oracle on upstream behaviours whose paths the inner loop's parity tests take.
pytestmark = pytest.mark.slow


# -- FSDP1 wrapper helpers ---------------------------------------------------------------------------
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


@contextlib.contextmanager
def reduction_dtypes(lib) -> Any:
    """The dtypes of the gradient reductions issued inside the block."""
    dtypes: set[torch.dtype] = set()
    with reductions(lib) as found:
        yield dtypes
    dtypes.update(dtype for _, dtype, _ in found)


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
