"""``FSDPModule``'s run-time settings, each against torch's FSDP2 doing the same
(its behaviour is the spec) and against what the setting promises:
set_reshard_after_forward, set_gradient_divide_factor, set_requires_all_reduce,
set_unshard_in_backward and set_reduce_scatter_unused_params."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from fullshard import MixedPrecisionPolicy, fully_shard, hybrid_mesh
from fullshard._core import comm
from fullshard.models import ModelArgs, Transformer
from fullshard.testing import assert_params_equal, distributed, run_distributed

ARGS = ModelArgs(n_layers=2, vocab_size=32, max_seq_len=8, dim=16, n_heads=4)


def set_divide_factor(model: nn.Module, factor: float) -> None:
    """On every unit. torch's FSDP2 then reduces fp32 with PREMUL_SUM, which gloo
    lacks; forcing sum reductions gives it the same arithmetic as ours."""
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(factor)
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)


def twins(mesh=None, reduce_dtype=None, **kwargs):
    """The same transformer sharded by fullshard and by torch's FSDP2, one unit per block."""
    torch.manual_seed(0)
    ours = Transformer(ARGS)
    theirs = copy.deepcopy(ours)
    for shard, model, policy in (
        (fully_shard, ours, MixedPrecisionPolicy(reduce_dtype=reduce_dtype)),
        (torch_fully_shard, theirs, TorchMixedPrecisionPolicy(reduce_dtype=reduce_dtype)),
    ):
        for layer in model.layers:
            shard(layer, mesh=mesh, mp_policy=policy, **kwargs)
        shard(model, mesh=mesh, mp_policy=policy, **kwargs)
    return ours, theirs


def tokens(micro_batch: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * dist.get_rank() + micro_batch)
    return torch.randint(ARGS.vocab_size, (2, 8), generator=generator)


def backward(model: nn.Module, micro_batch: int = 0) -> None:
    batch = tokens(micro_batch)
    model.loss(batch, batch).backward()


def assert_grads_equal(ours: nn.Module, theirs: nn.Module, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for (name, param), (_, other) in zip(ours.named_parameters(), theirs.named_parameters()):
        torch.testing.assert_close(param.grad.full_tensor(), other.grad.full_tensor(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{name}.grad: {m}")


def registered_sharded(model: nn.Module) -> list[bool]:
    """For each registered parameter, whether it is the shard (a DTensor) rather than the full tensor."""
    return [isinstance(p, DTensor) for p in model.parameters()]


@distributed(world_size=2)
def test_set_reshard_after_forward_matches_fsdp2():
    ours, theirs = twins()
    for model in (ours, theirs):
        model.set_reshard_after_forward(True, recurse=False)  # the root, kept unsharded by default
        model.layers[0].set_reshard_after_forward(False)
    outputs = []
    for model in (ours, theirs):
        loss = model.loss(tokens(), tokens())
        outputs.append((registered_sharded(model), loss))
    assert outputs[0][0] == outputs[1][0]
    assert not all(outputs[0][0]) and any(outputs[0][0])  # layer 0 kept full, the root resharded
    assert all(isinstance(p, DTensor) for p in ours.tok_embeddings.parameters())
    assert not any(isinstance(p, DTensor) for p in ours.layers[0].parameters())
    for (_, loss), model in zip(outputs, (ours, theirs)):
        loss.backward()
    assert_grads_equal(ours, theirs)
    with pytest.raises(TypeError, match="expects a bool"):
        ours.set_reshard_after_forward(2)


@distributed(world_size=4)
def test_set_reshard_after_forward_replaces_an_int():
    """reshard_after_forward=2 keeps half of each unit after forward; True then reshards fully."""
    ours, theirs = twins(reshard_after_forward=2)
    with comm.record_comms() as before:
        backward(ours)
    assert {r.group_size for r in before if r.op == "all_gather"} == {4, 2}  # backward re-gathers from pairs
    for model in (ours, theirs):
        model.zero_grad()
        model.set_reshard_after_forward(True)  # every unit below too
    with comm.record_comms() as after:
        for model in (ours, theirs):
            backward(model, micro_batch=1)
    assert {r.group_size for r in after if r.op == "all_gather"} == {4}
    assert_grads_equal(ours, theirs)


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("factor", [1.0, 3.0])
@distributed(world_size=2)
def test_gradient_divide_factor_matches_fsdp2(factor, reduce_dtype):
    """The sum over ranks divided by ``factor``; with float16 part of it before the sum."""
    ours, theirs = twins(reduce_dtype=reduce_dtype)
    averaged, _ = twins(reduce_dtype=reduce_dtype)
    for model in (ours, theirs):
        set_divide_factor(model, factor)
    for model in (ours, theirs, averaged):
        backward(model)
    tolerance = {"rtol": 1e-3, "atol": 1e-3} if reduce_dtype == torch.float16 else {}
    assert_grads_equal(ours, theirs, **tolerance)
    scale = dist.get_world_size() / factor
    for param, reference in zip(ours.parameters(), averaged.parameters()):
        torch.testing.assert_close(param.grad.full_tensor(), reference.grad.full_tensor() * scale, **(
            tolerance or {"rtol": 1e-5, "atol": 1e-6}))
    with pytest.raises(ValueError, match="positive factor"):
        ours.set_gradient_divide_factor(0.0)
    with pytest.warns(FutureWarning, match="set_gradient_divide_factor"):
        ours.set_reduce_scatter_divide_factor(factor)  # the older name: same checks, same effect
    with pytest.raises(ValueError, match="positive factor"), pytest.warns(FutureWarning):
        ours.set_reduce_scatter_divide_factor(-1.0)


@distributed(world_size=4)
def test_gradient_divide_factor_hsdp_matches_fsdp2():
    mesh = hybrid_mesh("cpu", num_devices_per_node=2)
    ours, theirs = twins(mesh=mesh)
    for model in (ours, theirs):
        set_divide_factor(model, 1.0)
        backward(model)
    assert_grads_equal(ours, theirs)


@distributed(world_size=4)
def test_requires_all_reduce_accumulates_with_one_all_reduce():
    """HSDP 2x2, two micro-batches: the first reduce-scatters only, the second
    adds its result in before the one all-reduce. Same gradients as FSDP2 doing
    the same, and as accumulating with every collective."""
    mesh = hybrid_mesh("cpu", num_devices_per_node=2)
    ours, theirs = twins(mesh=mesh)
    always, _ = twins(mesh=mesh)
    for model in (ours, theirs):
        model.set_requires_all_reduce(False)
    with comm.record_comms() as first:
        backward(ours, micro_batch=0)
    backward(theirs, micro_batch=0)
    assert all(p.grad is None for p in ours.parameters())  # nothing final yet
    for model in (ours, theirs):
        model.set_requires_all_reduce(True)
    with comm.record_comms() as second:
        backward(ours, micro_batch=1)
    backward(theirs, micro_batch=1)
    units = 1 + ARGS.n_layers
    assert [r.op for r in first].count("all_reduce") == 0
    assert [r.op for r in first].count("reduce_scatter") == units
    assert [r.op for r in second].count("all_reduce") == units
    backward(always, micro_batch=0)
    backward(always, micro_batch=1)
    assert_grads_equal(ours, theirs)
    assert_grads_equal(ours, always)


def embedding_then_linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32))


@distributed(world_size=2)
def test_unshard_in_backward_false_skips_the_gather():
    """An embedding's backward needs only its indices: its unit need not be gathered."""
    models = []
    for shard in (fully_shard, torch_fully_shard, fully_shard):
        model = embedding_then_linear()
        shard(model[0])
        shard(model)
        models.append(model)
    ours, theirs, gathered = models
    ours[0].set_unshard_in_backward(False)
    theirs[0].set_unshard_in_backward(False)
    batch = tokens()
    records = {}
    for name, model in (("ours", ours), ("theirs", theirs), ("gathered", gathered)):
        loss = nn.functional.cross_entropy(model(batch).flatten(0, 1), batch.flatten())
        with comm.record_comms() as records[name]:
            loss.backward()
    assert [r.op for r in records["gathered"]].count("all_gather") == 1  # the embedding, resharded after forward
    assert [r.op for r in records["ours"]].count("all_gather") == 0
    assert_grads_equal(ours, theirs)
    assert_params_equal(ours, gathered)
    assert_grads_equal(ours, gathered)


class Experts(nn.Module):
    """A shared layer, then the expert each call names (routing that differs by rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return self.experts[expert](self.shared(x).relu())


@distributed(world_size=2)
def test_reduce_scatter_unused_params_trains_rank_dependent_experts():
    """Rank r routes to expert r, expert 2 is used by nobody: with unused parameters
    reduced, every gradient is one process's over both ranks' data (expert 2's: zero),
    as torch's FSDP2 gives. By default, as in torch, each rank reduces only what it
    used, so the ranks reduce different experts together."""
    torch.manual_seed(0)
    ref = Experts()
    data = [torch.randn(3, 4, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    (sum(ref(x, r).square().mean() for r, x in enumerate(data)) / 2).backward()
    rank = dist.get_rank()
    models = {}
    for name, shard in (("ours", fully_shard), ("theirs", torch_fully_shard)):
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        shard(model)
        if name == "ours" or hasattr(model, "set_reduce_scatter_unused_params"):  # torch 2.13 and later
            model.set_reduce_scatter_unused_params(True)
            model(data[rank], rank).square().mean().backward()
            models[name] = model
    for name, param in models["ours"].named_parameters():
        expected = ref.get_parameter(name).grad
        expected = torch.zeros_like(param.full_tensor()) if expected is None else expected
        torch.testing.assert_close(param.grad.full_tensor(), expected, rtol=1e-5, atol=1e-6, msg=name)
    if "theirs" in models:
        assert_grads_equal(models["ours"], models["theirs"])


def test_all_reduce_hook_matches_fsdp2():
    for world, hybrid in ((2, False), (4, True)):
        run_distributed(_all_reduce_hook_run, world, hybrid)


def _all_reduce_hook_run(hybrid: bool):
    """A hook that doubles each reduced shard in place, on every block: the blocks'
    gradients come out doubled, as in FSDP2; not called for a partial (no
    all-reduce) backward."""
    mesh = hybrid_mesh("cpu", num_devices_per_node=2) if hybrid else None
    ours, theirs = twins(mesh=mesh)
    plain, _ = twins(mesh=mesh)
    calls = []

    def doubling(reduced: torch.Tensor) -> None:
        calls.append(reduced.numel())
        reduced.mul_(2)

    for model in (ours, theirs):
        for layer in model.layers:
            layer.set_all_reduce_hook(doubling)
    if hybrid:
        for model in (ours, theirs, plain):
            model.set_requires_all_reduce(False)
            backward(model, micro_batch=0)
            model.set_requires_all_reduce(True)
        assert calls == []  # only the final reduction is hooked
    backward(ours, micro_batch=1)
    assert len(calls) == ARGS.n_layers
    for model in (theirs, plain):
        backward(model, micro_batch=1)
    assert_grads_equal(ours, theirs)
    for (name, param), reference in zip(ours.named_parameters(), plain.parameters()):
        factor = 2.0 if name.startswith("layers.") else 1.0
        torch.testing.assert_close(param.grad.full_tensor(), reference.grad.full_tensor() * factor)
    with pytest.raises(NotImplementedError, match="stream"):
        ours.layers[0].set_all_reduce_hook(doubling, stream=object())


@distributed(world_size=4)
def test_force_sum_reduction_uses_only_sums():
    """HSDP 2x2: every reduction op is SUM; the gradients equal the AVG path's and FSDP2's."""
    mesh = hybrid_mesh("cpu", num_devices_per_node=2)
    ours, theirs = twins(mesh=mesh)
    averaged, _ = twins(mesh=mesh)
    for model in (ours, theirs):
        for module in model.modules():
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)
    ops = []
    originals = {"reduce_scatter": comm.reduce_scatter, "all_reduce": comm.all_reduce}
    op_index = {"reduce_scatter": 3, "all_reduce": 2}  # (output, input, group, op) / (tensor, group, op)

    def recording(name):
        def collective(*args, **kwargs):
            ops.append(args[op_index[name]])
            return originals[name](*args, **kwargs)

        return collective

    try:
        for name in originals:
            setattr(comm, name, recording(name))
        backward(ours)
    finally:
        for name, original in originals.items():
            setattr(comm, name, original)
    assert len(ops) == 2 * (1 + ARGS.n_layers) and all(op == dist.ReduceOp.SUM for op in ops), ops
    for model in (theirs, averaged):
        backward(model)
    assert_grads_equal(ours, theirs)
    assert_grads_equal(ours, averaged)
