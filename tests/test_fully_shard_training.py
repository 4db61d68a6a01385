"""Training parity of ``fully_shard`` against one process training on the whole batch.

Model: a transformer (embeddings, attention + MLP blocks with LayerNorm, output
weight tied to the embedding), one unit per block, the rest in the root unit.
fp32 runs must match the local reference to 1e-5 relative.
"""

import copy
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard, replicate, set_all_gather_bucket_size
from fullshard._core import comm
from fullshard.models import MLP, ModelArgs, Transformer
from fullshard.testing import (
    DataParallelReference,
    assert_params_equal,
    distributed,
    mean_over,
    run_distributed,
    split_batch,
    train_in_parity,
)

ARGS = ModelArgs(n_layers=3, vocab_size=32, max_seq_len=8, dim=16, n_heads=4)


def make_transformer(seed: int = 0, args: ModelArgs = ARGS) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(args)


def shard_transformer(model: Transformer, **kwargs) -> Transformer:
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def token_batches(num: int, batch: int = 8, seq: int = 8, vocab: int = ARGS.vocab_size, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(vocab, (batch, seq), generator=generator), torch.randint(vocab, (batch, seq), generator=generator))
        for _ in range(num)
    ]


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    tokens, targets = batch
    return model.loss(tokens, targets)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def run_parity(shard_kwargs: dict, num_steps: int = 5, **parity_kwargs) -> None:
    ref = make_transformer()
    model = shard_transformer(copy.deepcopy(ref), **shard_kwargs)
    train_in_parity(model, ref, adamw(model), adamw(ref), token_batches(num_steps), lm_loss, **parity_kwargs)
    assert_params_equal(model, ref)


@pytest.mark.parametrize("reshard_after_forward", [True, False, None])
@distributed(world_size=2)
def test_parity_world2(reshard_after_forward):
    run_parity({"reshard_after_forward": reshard_after_forward})


@pytest.mark.parametrize("reshard_after_forward", [True, False, 2])
@distributed(world_size=4)
def test_parity_world4(reshard_after_forward):
    run_parity({"reshard_after_forward": reshard_after_forward})


@pytest.mark.parametrize("reshard_after_forward", [True, False])
@distributed(world_size=4)
def test_parity_hsdp_2x2(reshard_after_forward):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    run_parity({"mesh": mesh, "reshard_after_forward": reshard_after_forward})


@pytest.mark.parametrize("shape", [(2, 1), (1, 2)])
@distributed(world_size=2)
def test_parity_degenerate_hsdp(shape):
    """(n, 1) still averages across the n replicas; (1, n) is plain FSDP."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    with comm.record_comms() as records:
        run_parity({"mesh": mesh}, num_steps=2)
    ops = {r.op for r in records}
    if shape == (2, 1):
        assert ops == {"all_reduce"}  # no all-gather or reduce-scatter over a group of one
    else:
        assert ops == {"all_gather", "reduce_scatter"}


@pytest.mark.parametrize("world_size", [2, 4])
def test_parity_cpu_offload(world_size):
    run_distributed(_cpu_offload_parity, world_size)


def _cpu_offload_parity():
    """On a CPU mesh the shards already live on the CPU; this checks the offload
    code path (host copies, gradients to the CPU) keeps training identical."""
    ref = make_transformer()
    model = shard_transformer(copy.deepcopy(ref), offload_policy=CPUOffloadPolicy(pin_memory=False))
    train_in_parity(model, ref, adamw(model), adamw(ref), token_batches(5), lm_loss)
    assert_params_equal(model, ref)
    for param in model.parameters():
        assert param.to_local().device.type == "cpu" and param.grad is None


@pytest.mark.parametrize("hsdp", [False, True])
@distributed(world_size=4)
def test_parity_gradient_accumulation(hsdp):
    """Micro-batches without sync accumulate unsharded; the last one reduces the sum."""
    mesh = init_device_mesh("cpu", (2, 2)) if hsdp else None
    ref = make_transformer()
    model = shard_transformer(copy.deepcopy(ref), mesh=mesh)

    def before_microbatch(index: int, is_last: bool) -> None:
        model.set_requires_gradient_sync(is_last)

    with comm.record_comms() as records:
        train_in_parity(
            model, ref, adamw(model), adamw(ref), token_batches(5, batch=16), lm_loss,
            num_microbatches=2, before_microbatch=before_microbatch,
        )
    num_units = len(ref.layers) + 1
    # Once per step and unit, not once per micro-batch.
    assert sum(r.op == "reduce_scatter" for r in records) == 5 * num_units
    assert sum(r.op == "all_reduce" for r in records) == (5 * num_units if hsdp else 0)
    assert_params_equal(model, ref)


@distributed(world_size=2)
def test_parity_gradient_accumulation_mixed_precision():
    """Without sync, bf16 gradients are summed in the fp32 reduce dtype."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ref = make_transformer()
    model = shard_transformer(copy.deepcopy(ref), mp_policy=policy)
    oracle = DataParallelReference(ref, lm_loss, torch.bfloat16)
    optim, ref_optim = adamw(model), adamw(ref)
    for batch in token_batches(5, batch=16):
        local = split_batch(batch, dist.get_rank(), 2)
        for index, micro in enumerate(zip(*(t.chunk(2) for t in local))):
            model.set_requires_gradient_sync(index == 1)
            (lm_loss(model, micro) / 2).backward()
        oracle.backward([split_batch(batch, r, 2) for r in range(2)], num_microbatches=2)
        optim.step()
        optim.zero_grad()
        ref_optim.step()
        ref_optim.zero_grad()
    assert_params_equal(model, ref, rtol=1e-4, atol=1e-5)


@distributed(world_size=2)
def test_reshard_after_backward_false_keeps_parameters():
    ref = make_transformer()
    model = shard_transformer(copy.deepcopy(ref))
    set_all_gather_bucket_size(model, 0)  # the counts below are one gather per unit
    optim, ref_optim = adamw(model), adamw(ref)
    batch = token_batches(1, batch=16)[0]
    local = split_batch(batch, dist.get_rank(), 2)
    model.set_reshard_after_backward(False)
    with comm.record_comms() as records:
        for index, micro in enumerate(zip(*(t.chunk(2) for t in local))):
            model.set_requires_gradient_sync(index == 1)
            (lm_loss(model, micro) / 2).backward()
    all_gathers = [r for r in records if r.op == "all_gather"]
    # Micro-batch 1 gathers every unit in forward and the blocks again in backward;
    # micro-batch 2 finds them still gathered in forward (saved: 1 + L gathers).
    num_layers = len(ref.layers)
    assert len(all_gathers) == (1 + num_layers) + num_layers + 0 + num_layers
    for layer in model.layers:
        assert fully_shard.state(layer).group.is_unsharded
    model.reshard()  # parameters must be sharded again before the optimizer step
    for layer in model.layers:
        layer.reshard()
    optim.step()
    (lm_loss(ref, batch)).backward()
    ref_optim.step()
    assert_params_equal(model, ref)


@distributed(world_size=2)
def test_parity_mixed_precision():
    """bf16 params and compute, fp32 reduction and optimizer.

    Tolerance: 1e-4 relative. The reference reproduces the arithmetic (bf16
    forward/backward on each rank's slice, gradients cast to fp32 and averaged),
    so only fp32 summation order differs; torch's own FSDP2 with the same
    policy must agree as well.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ref = make_transformer()
    model = shard_transformer(copy.deepcopy(ref), mp_policy=policy)
    oracle_model = copy.deepcopy(ref)
    torch_policy = TorchPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in oracle_model.layers:
        torch_fully_shard(layer, mp_policy=torch_policy)
    torch_fully_shard(oracle_model, mp_policy=torch_policy)
    emulated = DataParallelReference(ref, lm_loss, torch.bfloat16)
    optims = [adamw(m) for m in (model, oracle_model, ref)]
    rank = dist.get_rank()
    for step, batch in enumerate(token_batches(5)):
        local = split_batch(batch, rank, 2)
        losses = []
        for m in (model, oracle_model):
            loss = lm_loss(m, local)
            loss.backward()
            losses.append(mean_over(loss.float()))
        ref_loss = emulated.backward([split_batch(batch, r, 2) for r in range(2)])
        for optim in optims:
            optim.step()
            optim.zero_grad()
        torch.testing.assert_close(losses[0], ref_loss, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
    assert_params_equal(model, ref, rtol=1e-4, atol=1e-5)
    assert_params_equal(model, oracle_model, rtol=1e-4, atol=1e-5)


@distributed(world_size=2)
def test_mixed_precision_output_dtype_and_input_cast():
    seen = {}
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].register_forward_pre_hook(lambda m, args: seen.update(input=args[0].dtype))
    fully_shard(model[0], mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32))
    fully_shard(model[1], mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))  # casts its fp32 input
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    out = model(torch.randn(2, 4))
    assert seen["input"] == torch.bfloat16  # cast_forward_inputs
    assert out.dtype == torch.bfloat16  # no output_dtype: outputs stay in the compute dtype
    assert model[0](torch.randn(2, 4)).dtype == torch.float32  # output_dtype
    out.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())  # grads in the shards' dtype


@distributed(world_size=2)
def test_parity_tied_weight_and_module_used_twice():
    torch.manual_seed(0)
    block = MLP(8)
    ref = nn.Sequential(block, nn.ReLU(), block, nn.Linear(8, 8))  # one module, two uses
    model = copy.deepcopy(ref)
    fully_shard(model[0])  # model[0] is model[2]: one unit, gathered for each use
    fully_shard(model)
    batches = [(torch.randn(8, 8),) for _ in range(4)]
    train_in_parity(model, ref, adamw(model), adamw(ref), batches, lambda m, b: m(b[0]).square().mean())
    assert_params_equal(model, ref)


class Branchy(nn.Module):
    """Uses `b` only on even steps: its parameters get no gradient on odd ones."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 2)
        self.use_b = True

    def forward(self, x):
        x = self.a(x)
        return self.head(self.b(x) if self.use_b else x)


@pytest.mark.parametrize("own_unit", [False, True])
@distributed(world_size=2)
def test_parity_unused_parameters(own_unit):
    torch.manual_seed(0)
    ref = Branchy()
    model = copy.deepcopy(ref)
    if own_unit:
        fully_shard(model.b)
    fully_shard(model)
    optim, ref_optim = adamw(model), adamw(ref)
    for step in range(4):
        model.use_b = ref.use_b = step % 2 == 0
        batch = (torch.randn(8, 6),)
        train_in_parity(model, ref, optim, ref_optim, [batch], lambda m, b: m(b[0]).square().mean())
    assert_params_equal(model, ref)


@distributed(world_size=2)
def test_parity_frozen_parameters():
    """Frozen parameters are gathered but never reduced; a fully frozen unit in the
    middle is resharded as soon as its backward is over."""
    ref = make_transformer()
    ref.layers[1].requires_grad_(False)
    ref.layers[0].attention.wq.weight.requires_grad_(False)
    model = copy.deepcopy(ref)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    frozen_group = fully_shard.state(model.layers[1]).group
    states_when_layer0_backward_starts = []
    model.layers[0].register_full_backward_pre_hook(
        lambda m, g: states_when_layer0_backward_starts.append(frozen_group.is_unsharded)
    )
    with comm.record_comms() as records:
        train_in_parity(model, ref, adamw(model), adamw(ref), token_batches(3), lm_loss)
    assert states_when_layer0_backward_starts == [False, False, False]
    assert sum(r.op == "reduce_scatter" for r in records) == 3 * (len(ref.layers) + 1 - 1)
    assert model.layers[1].attention.wq.weight.grad is None
    assert_params_equal(model, ref)


@distributed(world_size=2)
def test_parity_replicate():
    ref = make_transformer()
    model = copy.deepcopy(ref)
    replicate(model)
    with comm.record_comms() as records:
        train_in_parity(model, ref, adamw(model), adamw(ref), token_batches(3), lm_loss)
    assert {r.op for r in records} == {"all_reduce"}
    assert_params_equal(model, ref)


@distributed(world_size=2)
def test_parity_replicate_inside_fully_shard():
    ref = make_transformer()
    model = copy.deepcopy(ref)
    replicate(model.layers[0])
    for layer in model.layers[1:]:
        fully_shard(layer)
    fully_shard(model)
    train_in_parity(model, ref, adamw(model), adamw(ref), token_batches(3), lm_loss)
    assert_params_equal(model, ref)


@distributed(world_size=4)
def test_parity_tensor_parallel():
    """2D: TP over pairs of ranks, FSDP across the pairs.

    TP splits matmul reductions across ranks, so gradients round differently;
    Adam's normalization turns that into absolute differences of a few 1e-6
    on near-zero gradients: atol 1e-5 (losses still match to 1e-5 relative).
    """
    global_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref = make_transformer()
    model = copy.deepcopy(ref)
    plan = {
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(),
    }
    for layer in model.layers:
        parallelize_module(layer, global_mesh["tp"], plan)
    shard_transformer(model, mesh=global_mesh["dp"])
    batches = token_batches(4)
    train_in_parity(
        model, ref, adamw(model), adamw(ref), batches, lm_loss,
        dp_rank=global_mesh.get_local_rank("dp"), dp_size=2,
    )
    assert_params_equal(model, ref, atol=1e-5)


class MixedDtypes(nn.Module):
    """fp32 and fp64 parameters in one unit: one flat byte buffer holds both."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.randn(6, dtype=torch.float64))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.proj(x) * self.scale.float())


@distributed(world_size=2)
def test_parity_mixed_parameter_dtypes():
    torch.manual_seed(0)
    ref = MixedDtypes()
    model = copy.deepcopy(ref)
    fully_shard(model)
    group = fully_shard.state(model).group
    assert group.buffers.shard_buffer.dtype == torch.uint8  # bytes: fp32 and fp64 shards side by side
    assert model.scale.dtype == torch.float64 and model.scale.to_local().dtype == torch.float64
    batches = [(torch.randn(8, 6),) for _ in range(5)]
    train_in_parity(model, ref, adamw(model), adamw(ref), batches, lambda m, b: m(b[0]).square().mean())
    assert_params_equal(model, ref)
    model(torch.randn(2, 6)).sum().backward()
    assert model.scale.grad.dtype == torch.float64 and model.proj.weight.grad.dtype == torch.float32


@distributed(world_size=1)
def test_parity_world1():
    """One rank: the unsharded parameters alias the shards; nothing is communicated."""
    ref = make_transformer()
    model = shard_transformer(copy.deepcopy(ref))
    with comm.record_comms() as records:
        train_in_parity(model, ref, adamw(model), adamw(ref), token_batches(5), lm_loss)
    assert records == []
    assert_params_equal(model, ref)


class Checkpointed(nn.Module):
    """Recomputes the wrapped block in backward (non-reentrant activation checkpointing)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.parametrize("checkpointing", ["unit inside", "torch wrapper, reentrant", "torch wrapper, non-reentrant"])
@distributed(world_size=2)
def test_parity_activation_checkpointing(checkpointing, reshard_after_forward):
    """A unit inside ``torch.utils.checkpoint``, or (as torchtitan does) torch's
    ``checkpoint_wrapper`` made a unit, with either of its implementations."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    ref = make_transformer()
    model = copy.deepcopy(ref)
    for index, layer in enumerate(model.layers):
        if checkpointing == "unit inside":
            fully_shard(layer, reshard_after_forward=reshard_after_forward)
            model.layers[index] = Checkpointed(layer)
        else:
            impl = CheckpointImpl.REENTRANT if checkpointing.endswith(", reentrant") else CheckpointImpl.NO_REENTRANT
            model.layers[index] = checkpoint_wrapper(layer, checkpoint_impl=impl)
            fully_shard(model.layers[index], reshard_after_forward=reshard_after_forward)
    fully_shard(model)
    set_all_gather_bucket_size(model, 0)  # the count below is one gather per unit
    with comm.record_comms() as records:
        train_in_parity(model, ref, adamw(model), adamw(ref), token_batches(5), lm_loss)
    # Recomputation reuses the gather that backward needs anyway: no extra all-gathers.
    per_step = sum(r.op == "all_gather" for r in records) / 5
    assert per_step == 1 + len(ref.layers) * (2 if reshard_after_forward else 1)
    assert_params_equal(model, ref, match_names=False)


class Fails:
    """A hook that raises while armed: an exception in the middle of a step."""

    def __init__(self) -> None:
        self.armed = True

    def __call__(self, *_) -> None:
        if self.armed:
            raise RuntimeError("cut short")


@pytest.mark.parametrize("recovery", ["reset_iter_state", "next forward"])
@pytest.mark.parametrize("where", ["forward", "backward"])
@distributed(world_size=2)
def test_step_cut_short_by_an_exception(where, recovery):
    """A step an exception stops midway (an out-of-memory error caught to skip the
    batch) leaves nothing behind: its gradients are dropped, every unit is resharded
    and training goes on exactly as one process that never saw the batch. The root's
    next forward does it by itself, with a warning, if reset_iter_state() is not called."""
    ref = make_transformer()
    model = shard_transformer(copy.deepcopy(ref))
    optims = adamw(model), adamw(ref)  # made first: they hold the sharded parameters
    fails = Fails()
    if where == "forward":
        model.layers[1].register_forward_pre_hook(fails)
        step = lambda: lm_loss(model, token_batches(1)[0])  # noqa: E731
    else:
        model.layers[0].register_full_backward_pre_hook(fails)  # after the last layer's and the root's reduction
        step = lambda: lm_loss(model, token_batches(1)[0]).backward()  # noqa: E731
    with pytest.raises(RuntimeError, match="cut short"):
        step()
    fails.armed = False
    if recovery == "reset_iter_state":
        with pytest.raises(RuntimeError, match=r"reset_iter_state\(\) must be called on the root .* not on TransformerBlock"):
            model.layers[0].reset_iter_state()
        model.reset_iter_state()
        assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())  # resharded
    for param in model.parameters():
        param.grad = None  # what the failed backward's finished reductions wrote
    context = pytest.warns(UserWarning, match="stopped midway") if recovery == "next forward" else nullcontext()
    with context:
        train_in_parity(model, ref, *optims, token_batches(3, seed=5), lm_loss)
    assert_params_equal(model, ref)
