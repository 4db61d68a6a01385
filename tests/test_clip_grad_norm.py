"""clip_grad_norm_: the true global norm over shards, replicas and mixed meshes.

Each case runs one backward on the sharded model and the same step on a local
reference, clips both with torch.nn.utils.clip_grad_norm_ semantics, and
compares the total norm and every clipped gradient. All ranks see the same
data, so even parameters outside any unit (not reduced) match the reference.
"""

import copy
import math
import os

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fullshard
from fullshard import FSDP, ShardingStrategy, fully_shard
from fullshard.models import ModelArgs, Transformer, TransformerBlock
from fullshard.testing import assert_params_equal, distributed
from fullshard.wrap import ModuleWrapPolicy

CPU = torch.device("cpu")
ARGS = ModelArgs(n_layers=2, vocab_size=32, max_seq_len=8, dim=16)


def make_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ARGS)


def check_clip(model: nn.Module, ref: nn.Module, clip, norm_type: float = 2.0) -> None:
    tokens = torch.randint(ARGS.vocab_size, (4, 8), generator=torch.Generator().manual_seed(3))
    for m in (model, ref):
        nn.functional.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten()).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.1, norm_type=norm_type)
    total = clip(0.1, norm_type)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)
    assert expected > 0.1  # clipping really happened
    return total


def reference_grads_match(model: nn.Module, ref: nn.Module) -> None:
    with FSDP.summon_full_params(model, with_grads=True):
        assert_params_equal(model, ref, grads=True, match_names=False)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("layout", ["fsdp", "hsdp", "hsdp_blocks_fsdp_root"])
@distributed(world_size=4)
def test_fully_shard_meshes(layout, norm_type):
    ref = make_model()
    model = copy.deepcopy(ref)
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for layer in model.layers:
        fully_shard(layer, mesh=hsdp if layout != "fsdp" else None)
    fully_shard(model, mesh=hsdp if layout == "hsdp" else None)
    check_clip(model, ref, lambda m, p: fullshard.clip_grad_norm_(model.parameters(), m, p), norm_type)
    reference_grads_match(model, ref)


@distributed(world_size=4)
def test_fully_shard_with_tensor_parallel_and_plain_parameters():
    ref = make_model()
    ref.scale = nn.Parameter(torch.ones(ARGS.vocab_size))  # outside any unit
    ref.forward = _scaled_forward(ref)
    model = copy.deepcopy(ref)
    model.forward = _scaled_forward(model)
    global_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {"feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel()}
    for layer in model.layers:
        parallelize_module(layer, global_mesh["tp"], plan)
        fully_shard(layer, mesh=global_mesh["dp"])
    fully_shard(model, mesh=global_mesh["dp"], ignored_params={model.scale})
    check_clip(model, ref, lambda m, p: fullshard.clip_grad_norm_(model.parameters(), m, p))
    torch.testing.assert_close(model.scale.grad, ref.scale.grad)


def _scaled_forward(model: Transformer):
    forward = type(model).forward

    def scaled(tokens):
        return forward(model, tokens) * model.scale

    return scaled


@pytest.mark.parametrize(
    "strategy",
    [ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD, ShardingStrategy.NO_SHARD, "mixed"],
)
@pytest.mark.parametrize("use_orig_params", [False, True])
@distributed(world_size=4)
def test_wrapper(strategy, use_orig_params):
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    ref = make_model()
    model = copy.deepcopy(ref)
    kwargs = dict(device_id=CPU, use_orig_params=use_orig_params)
    if strategy == "mixed":  # HYBRID blocks under a FULL_SHARD root, an ignored final norm
        for index, layer in enumerate(model.layers):
            model.layers[index] = FSDP(
                layer, sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=fullshard.hybrid_mesh("cpu", 2), **kwargs
            )
        model = FSDP(model, ignored_modules=[model.norm], **kwargs)
    else:
        model = FSDP(model, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}), **kwargs)
    check_clip(model, ref, model.clip_grad_norm_)
    reference_grads_match(model, ref)


@distributed(world_size=2)
def test_wrapper_clip_needs_root():
    model = FSDP(make_model(), auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}), device_id=CPU)
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    with pytest.raises(RuntimeError, match="root FullyShardedDataParallel"):
        model.module.layers[0].clip_grad_norm_(1.0)


@distributed(world_size=2)
def test_wrapper_parameter_replaced_by_the_user():
    """use_orig_params=True: a Parameter the user registers in place of a shard is adopted
    as the shard (FSDP1's contract); its gradient still counts once per shard rank."""
    ref = make_model()
    model = FSDP(copy.deepcopy(ref), auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}), device_id=CPU,
                 use_orig_params=True)
    for module in model.module.layers[0].module.modules():  # each its 1D shard, as a new object
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(param.detach().clone()))
    check_clip(model, ref, model.clip_grad_norm_)
    reference_grads_match(model, ref)
