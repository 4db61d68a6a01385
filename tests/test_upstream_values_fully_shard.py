"""Value gaps from tests/UPSTREAM.md's work queue: ``fully_shard`` (FSDP2's front end).

Each is closed against torch's FSDP as the oracle: one body runs with each library
(tests/upstream_oracle.py says how).
"""

from __future__ import annotations

import contextlib
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
    TwoOutputs,
    api,
    assert_same,
    assert_same_run,
    both,
    both_outcomes,
    full_params,
    rank_batches,
    reductions,
    sgd_train,
    train_dropping_an_output,
)

import fullshard
from fullshard.testing import case, distributed, full_value

# Out of the inner loop: torch's oracle on upstream behaviours whose paths the inner loop's parity tests take.
pytestmark = pytest.mark.slow


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
