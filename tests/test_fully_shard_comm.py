"""What ``fully_shard`` communicates: collectives per step, bytes, groups, prefetch order."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fullshard import fully_shard, register_fsdp_forward_method, set_all_gather_bucket_size
from fullshard._core import comm
from fullshard.models import MLP, ModelArgs, Transformer
from fullshard.testing import assert_params_equal, distributed, run_distributed

ARGS = ModelArgs(n_layers=3, vocab_size=32, max_seq_len=8, dim=16, n_heads=4)


def sharded_transformer(**kwargs) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def train_step(model: nn.Module, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(ARGS.vocab_size, (4, 8), generator=generator)
    model.loss(tokens, tokens).backward()


def padded_bytes(model: nn.Module, world_size: int) -> int:
    """Bytes of all parameters, each padded to a multiple of world_size rows."""
    total = 0
    for param in model.parameters():
        rows = param.shape[0]
        padded_rows = -(-rows // world_size) * world_size
        total += padded_rows * (param.numel() // rows) * param.element_size()
    return total


@distributed(world_size=2)
def test_one_all_gather_and_one_reduce_scatter_per_unit():
    model = sharded_transformer(reshard_after_forward=True)
    set_all_gather_bucket_size(model, 0)  # one gather per unit (buckets: tests/test_bucketed_collectives.py)
    num_units = ARGS.n_layers + 1
    train_step(model)  # the first step records the order used for prefetching
    with comm.record_comms() as records:
        train_step(model, seed=1)
    ops = [r.op for r in records]
    assert ops.count("all_gather") == 2 * num_units  # forward + backward
    assert ops.count("reduce_scatter") == num_units
    assert ops.count("all_reduce") == 0
    # The ideal for full sharding: parameters gathered twice, reduced once.
    ideal = 3 * padded_bytes(model, 2)
    assert sum(r.nbytes for r in records) == ideal


@distributed(world_size=2)
def test_root_keeps_parameters_by_default():
    model = sharded_transformer()
    set_all_gather_bucket_size(model, 0)  # one gather per unit
    with comm.record_comms() as records:
        train_step(model)
    # reshard_after_forward=None: the root unit is gathered once per step.
    assert [r.op for r in records].count("all_gather") == 2 * ARGS.n_layers + 1


@distributed(world_size=4)
def test_int_reshard_regathers_from_smaller_group():
    model = sharded_transformer(reshard_after_forward=2)
    with comm.record_comms() as records:
        train_step(model)
    gathers = [r for r in records if r.op == "all_gather"]
    forward = [r for r in gathers if r.group_size == 4]
    backward = [r for r in gathers if r.group_size == 2]
    assert len(forward) == ARGS.n_layers + 1
    assert len(backward) == ARGS.n_layers + 1  # an explicit value applies to the root too
    # Each backward gather moves the same bytes as the forward one, from half as many ranks.
    assert sum(r.nbytes for r in backward) == sum(r.nbytes for r in forward)


@pytest.mark.parametrize("world_size", [2, 4])
def test_reshard_after_forward_int_validation(world_size):
    run_distributed(_check_int_validation, world_size)


def _check_int_validation():
    world = dist.get_world_size()
    with pytest.raises(ValueError, match=rf"divides the shard size {world}, but got 3 for MLP"):
        fully_shard(MLP(4), reshard_after_forward=3)
    # 1 means "keep everything"; the shard size means "reshard fully".
    assert fully_shard.state(fully_shard(MLP(4), reshard_after_forward=1)).group.settings.reshard_after_forward is False
    group = fully_shard.state(fully_shard(MLP(4), reshard_after_forward=world)).group
    assert group.settings.reshard_after_forward is True and group.settings.post_forward_group is None


# -- prefetch ---------------------------------------------------------------------------------
def _in_flight_or_gathered(module: nn.Module) -> bool:
    group = fully_shard.state(module).group
    return group.is_unsharded or group._all_gather is not None


@distributed(world_size=2)
def test_implicit_forward_and_backward_prefetch():
    model = sharded_transformer(reshard_after_forward=True)
    layers = list(model.layers)
    seen_forward, seen_backward = [], []
    for i, layer in enumerate(layers[:-1]):
        # Runs after our pre-forward hook: the next block's all-gather is already issued.
        layer.register_forward_pre_hook(lambda m, a, i=i: seen_forward.append(_in_flight_or_gathered(layers[i + 1])))
    for i, layer in enumerate(layers[1:], start=1):
        layer.register_full_backward_hook(lambda m, gi, go, i=i: seen_backward.append(_in_flight_or_gathered(layers[i - 1])))
    train_step(model)  # step 1 records the forward order
    assert seen_forward == [False] * (len(layers) - 1)
    assert seen_backward == [True] * (len(layers) - 1)  # backward uses this step's order
    seen_forward.clear()
    train_step(model, seed=1)
    assert seen_forward == [True] * (len(layers) - 1)
    # After the step everything is sharded again.
    assert not any(fully_shard.state(layer).group.is_unsharded for layer in layers)


@distributed(world_size=2)
def test_explicit_prefetch_lists():
    model = sharded_transformer(reshard_after_forward=True)
    layers = list(model.layers)
    # Prefetch two blocks ahead in forward, and two behind in backward.
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 3])
        layer.set_modules_to_backward_prefetch(layers[max(i - 2, 0) : i][::-1])
    seen = []
    layers[0].register_forward_pre_hook(lambda m, a: seen.append([_in_flight_or_gathered(l) for l in layers]))
    train_step(model)
    assert seen == [[True, True, True]]
    with pytest.raises(ValueError, match="expects modules that fully_shard was applied to, but got MLP"):
        layers[0].set_modules_to_forward_prefetch([MLP(4)])


@distributed(world_size=2)
def test_explicit_unshard_and_reshard():
    torch.manual_seed(0)
    model = nn.Sequential(MLP(4), MLP(4))
    ref = copy.deepcopy(model)
    fully_shard(model[0])
    fully_shard(model)
    handle = model[0].unshard(async_op=True)
    handle.wait()
    assert fully_shard.state(model[0]).group.is_unsharded
    assert model[0].in_proj.weight.shape == (16, 4) and not hasattr(model[0].in_proj.weight, "placements")
    torch.testing.assert_close(model[0].in_proj.weight, ref[0].in_proj.weight)
    with comm.record_comms() as records:
        out = model[0](torch.ones(2, 4))  # already gathered: no all-gather
    assert [r.op for r in records] == []
    torch.testing.assert_close(out, ref[0](torch.ones(2, 4)))
    model[0].unshard()
    model[0].reshard()
    assert not fully_shard.state(model[0]).group.is_unsharded
    assert model[0].in_proj.weight.placements is not None


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x)

    def generate(self, x, steps: int = 3):
        for _ in range(steps):
            x = self.proj(x)  # uses the parameters without going through forward
        return torch.tanh(self(x))  # forward inside a registered method reuses the gathered parameters


@distributed(world_size=2)
def test_register_fsdp_forward_method():
    torch.manual_seed(0)
    model = Generator()
    ref = copy.deepcopy(model)
    fully_shard(model, reshard_after_forward=True)
    with pytest.raises(RuntimeError, match="DTensor"):  # unregistered: proj still holds its shards
        model.generate(torch.ones(1, 4))
    register_fsdp_forward_method(model, "generate")
    with comm.record_comms() as records:
        out = model.generate(torch.ones(1, 4))
    assert [r.op for r in records] == ["all_gather"]  # once for the whole method
    torch.testing.assert_close(out, ref.generate(torch.ones(1, 4)))
    out.sum().backward()
    ref.generate(torch.ones(1, 4)).sum().backward()
    assert_params_equal(model, ref, grads=True)


@distributed(world_size=2)
def test_backward_twice_accumulates():
    """Two backward passes through one forward's graph add their reduced gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(MLP(4), MLP(4))
    ref = copy.deepcopy(model)
    fully_shard(model[0])
    fully_shard(model)
    x = torch.randn(4, 4).chunk(2)[dist.get_rank()]
    out = model(x)
    out.sum().backward(retain_graph=True)
    out.square().sum().backward()
    gathered = [torch.empty_like(x) for _ in range(2)]
    dist.all_gather(gathered, x)
    ref_out = ref(torch.cat(gathered))
    # Gradients are averaged over ranks: the reference loss is the per-rank mean.
    ((ref_out.sum() + ref_out.square().sum()) / 2).backward()
    assert_params_equal(model, ref, grads=True)


@distributed(world_size=2)
def test_eval_forward_without_grad_keeps_state_clean():
    model = sharded_transformer(reshard_after_forward=True)
    tokens = torch.randint(ARGS.vocab_size, (2, 8))
    with torch.no_grad():
        for _ in range(3):
            model(tokens)
    assert not any(fully_shard.state(layer).group.is_unsharded for layer in model.layers)
    train_step(model)
    for param in model.parameters():
        assert param.grad is not None


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_copy_in_matches_chunk_cat(world, grad_dtype):
    """The CPU reduce-scatter copy-in (chunk by chunk, casting bf16 gradients to
    fp32 on the way, no padded copies) lays out and pads exactly like
    ``torch._chunk_cat``."""
    from fullshard._core.reduce.reduction import chunk_cat

    torch.manual_seed(world)
    for shapes in ([(5, 3), (3,), (7, 2, 2)], [(1, 5)], [(8, 8), (16,)]):
        grads = [torch.randn(shape).to(grad_dtype) for shape in shapes]
        width = sum(-(-shape[0] // world) * (torch.Size(shape).numel() // shape[0]) for shape in shapes)
        expected = torch.full((world, width), float("nan"))
        torch._chunk_cat([g.float() for g in grads], dim=0, num_chunks=world, out=expected)
        out = torch.full((world, width), float("nan"))  # padding must be written, not left over
        chunk_cat(grads, out)
        assert torch.equal(out, expected), shapes
