"""Quantized all-gather (``set_all_gather_quantization``): what goes on the wire, what
every rank computes with, exact gradients with respect to it, and every front end and
mesh. See [Note: Quantized all-gather] in fullshard/_core/gather/codec/quantize.py.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from fullshard import (
    AllGatherQuantization,
    CPUOffloadPolicy,
    FullyShardedDataParallel,
    MixedPrecisionPolicy,
    fully_shard,
    set_all_gather_quantization,
)
from fullshard._core import comm
from fullshard._core.gather.codec.quantize import BlockQuantizer
from fullshard._core.step.state import get_state
from fullshard.models import ModelArgs, Transformer
from fullshard.plan import PlanConfig, estimate
from fullshard.testing import distributed, train_steps
from fullshard.wrap import ModuleWrapPolicy
from test_tensor_subclass_params import Bf16Gathered  # a tensor subclass with torch's FSDP2 gather hooks

ARGS = ModelArgs(n_layers=2, vocab_size=32, max_seq_len=8, dim=64, n_heads=4)
CODES = [torch.int8, torch.float8_e4m3fn]
NOTHING_EXACT = AllGatherQuantization(keep_exact=lambda module, name, param: False)


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(ARGS.vocab_size, (2, 8), generator=torch.Generator().manual_seed(seed))


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The next-token loss through ``model``'s forward (the wrapper gathers only there)."""
    logits = model(tokens)
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def _sharded(quantization: AllGatherQuantization | None, **kwargs) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    set_all_gather_quantization(model, quantization)
    return model


def _gathered_bytes(model: nn.Module) -> tuple[int, set[torch.dtype]]:
    with comm.record_comms() as records:
        _loss(model, _batch(0)).backward()
    gathers = [r for r in records if r.op == "all_gather"]
    return sum(r.nbytes for r in gathers), {r.dtype for r in gathers}


@distributed(world_size=2)
@pytest.mark.parametrize("code", CODES)
def test_about_half_the_bytes_of_a_bf16_gather(code: torch.dtype):
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    plain, plain_dtypes = _gathered_bytes(_sharded(None, mp_policy=bf16))
    assert plain_dtypes == {torch.bfloat16}
    everything = AllGatherQuantization(dtype=code, keep_exact=NOTHING_EXACT.keep_exact)
    coded, coded_dtypes = _gathered_bytes(_sharded(everything, mp_policy=bf16))
    assert coded_dtypes == {torch.uint8}  # float8 travels as its bytes: gloo has no float8
    assert coded <= 0.55 * plain
    # The default rule keeps norms and the embedding exact: more bytes, but still far under bf16.
    default, _ = _gathered_bytes(_sharded(AllGatherQuantization(dtype=code), mp_policy=bf16))
    assert coded < default < 0.7 * plain


@distributed(world_size=2)
@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_every_rank_computes_with_the_decoded_shards(code: torch.dtype, param_dtype: torch.dtype):
    """The gathered weight is, bit for bit, each rank's shard (cast to the compute dtype)
    encoded and decoded, then cast to the compute dtype."""
    quantization = AllGatherQuantization(dtype=code, block_size=32)
    model = _sharded(quantization, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype))
    linear = model.layers[0].attention.wq
    seen: list[torch.Tensor] = []
    linear.register_forward_pre_hook(lambda module, args: seen.append(module.weight.detach().clone()))
    _loss(model, _batch(0))
    gathered = seen[0]
    everyone = [torch.empty_like(gathered) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, gathered)
    assert all(torch.equal(other, gathered) for other in everyone)
    # wq is one of the unit's coded parameters: blocks run over all of them back to back,
    # so rebuild this rank's codes the same way from the unit's shards.
    group = get_state(model.layers[0]).group
    codec = group.settings.gather_wire.codec
    plan = codec._plan(group.buffers.gather_layout)
    layout, storage = group.buffers.gather_layout, group.buffers.storage_layout
    shard_buffer = group.buffers.shard_buffer  # fp32, as the optimizer steps on it
    values = torch.cat([storage.region(shard_buffer, i, torch.float32) for i in plan.coded]).to(param_dtype).float()
    quantizer = BlockQuantizer(code, 32)
    padded = torch.zeros(quantizer.num_blocks(values.numel()) * 32)
    padded[: values.numel()] = values
    packed = torch.empty(1, quantizer.packed_numel(values.numel()), dtype=torch.uint8)
    quantizer.encode(padded, packed[0])
    decoded = quantizer.decode(packed, values.numel())
    index = [p.module_info.module for p in group.spec.params].index(linear)
    start = sum(layout.sizes[i] for i in plan.coded[: plan.coded.index(index)])
    mine = decoded[0, start : start + layout.sizes[index]].to(param_dtype)
    rows = gathered.size(0) // dist.get_world_size()
    assert torch.equal(gathered[dist.get_rank() * rows : (dist.get_rank() + 1) * rows].reshape(-1), mine)
    assert not torch.equal(gathered, linear.weight.full_tensor())  # quantized, not the exact weight


@distributed(world_size=2)
def test_gradients_exact_with_respect_to_the_quantized_weights():
    """One process computing with the decoded weights gets our reduced gradients."""
    model = _sharded(AllGatherQuantization(block_size=16))
    used: dict[str, torch.Tensor] = {}

    def keep_weight(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            used[name] = module.weight.detach().clone()

        return hook

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(keep_weight(name + ".weight"))
    batches = [_batch(rank) for rank in range(dist.get_world_size())]
    _loss(model, batches[dist.get_rank()]).backward()
    torch.manual_seed(0)
    reference = Transformer(ARGS)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.copy_(used.get(name, dict(model.named_parameters())[name].full_tensor()))
    for batch in batches:
        (_loss(reference, batch) / len(batches)).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad.full_tensor(), dict(reference.named_parameters())[name].grad)


def assert_computes_with_decoded_weights(
    model: nn.Module, tokens: torch.Tensor | None = None, built_second: bool = False
) -> None:
    """Every Linear weight a forward of ``model`` computes with is its exact initial value (``Transformer(ARGS)``
    seeded 0; ``built_second``: the second one built after the seed, as the wrapper tests build theirs after
    the one their wrap policy reads its block type from) to within the code's rounding: the least-squares factor from the exact weight to the one used is 1
    within 1%. Rounding to the nearest code is unbiased, so this factor stays near 1; a decode off by a
    constant factor (every weight 10% smaller, or zero) is not.
    Losses over a few steps cannot see that: the next-token loss at initialisation hardly depends on scale."""
    torch.manual_seed(0)
    reference = Transformer(ARGS)
    if built_second:
        reference = Transformer(ARGS)
    exact = {n: m.weight.detach().float() for n, m in reference.named_modules() if isinstance(m, nn.Linear)}
    used: dict[str, torch.Tensor] = {}

    def keep(key: str):
        def hook(module: nn.Module, args: tuple) -> None:
            used.setdefault(key, module.weight.detach().float().clone())

        return hook

    handles = [
        module.register_forward_pre_hook(keep(name.replace("_fsdp_wrapped_module.", "")))
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
    ]
    try:
        with torch.no_grad():
            model(tokens if tokens is not None else _batch(0))
    finally:
        for handle in handles:
            handle.remove()
    assert set(used) == set(exact), (sorted(used), sorted(exact))
    for name, weight in exact.items():
        factor = ((used[name] * weight).sum() / weight.square().sum()).item()
        assert abs(factor - 1) < 0.01, f"{name}: the weight used is {factor:.4f} x the exact one"


def _train(model: nn.Module, steps: int = 4) -> list[float]:
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return train_steps(model, optim, [_batch(10 * step + dist.get_rank()) for step in range(steps)], _loss)


@distributed(world_size=2)
def test_trains_close_to_exact_and_can_be_turned_off():
    exact = _train(_sharded(None))
    coded = _train(_sharded(AllGatherQuantization()))
    assert exact != coded
    torch.testing.assert_close(torch.tensor(coded), torch.tensor(exact), rtol=1e-2, atol=0)
    assert_computes_with_decoded_weights(_sharded(AllGatherQuantization()))
    model = _sharded(AllGatherQuantization())
    set_all_gather_quantization(model, None)
    assert _train(model) == exact


@distributed(world_size=2)
def test_cpu_offload_sends_and_computes_the_same():
    coded = _train(_sharded(AllGatherQuantization()))
    offloaded = _train(_sharded(AllGatherQuantization(), offload_policy=CPUOffloadPolicy()))
    assert offloaded == coded


@distributed(world_size=4)
def test_backward_regather_within_a_smaller_group_is_quantized_too():
    model = _sharded(NOTHING_EXACT, reshard_after_forward=2)
    with comm.record_comms() as records:
        _loss(model, _batch(0)).backward()
    gathers = [r for r in records if r.op == "all_gather"]
    assert {r.group_size for r in gathers} == {2, 4}
    assert {r.dtype for r in gathers} == {torch.uint8}
    losses = _train(_sharded(NOTHING_EXACT, reshard_after_forward=2))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert_computes_with_decoded_weights(_sharded(NOTHING_EXACT, reshard_after_forward=2))
    # The backward computes with the re-gathered (pair-group) codes: its gradients are those of the
    # full-group gather's codes to within the codes' rounding, not of zeros or scaled weights.
    grads = []
    for reshard in (2, True):
        model = _sharded(NOTHING_EXACT, reshard_after_forward=reshard)
        _loss(model, _batch(dist.get_rank())).backward()
        grads.append(torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()]))
    factor = ((grads[0] * grads[1]).sum() / grads[1].square().sum()).item()
    assert abs(factor - 1) < 0.05, factor


@distributed(world_size=4)
def test_codes_are_written_into_the_gather_output_and_arrive_alike_by_either_gloo_way():
    """Each rank encodes straight into its row of the all-gather output (the collective copies
    nothing in); gloo's native all-gather (small units, in place) and one broadcast per rank
    deliver the same bits."""
    in_place: list[bool] = []

    def check_input(record: comm.CommRecord, tensors: list[torch.Tensor]) -> None:
        if record.op == "all_gather" and record.dtype == torch.uint8:
            output, source = tensors
            row = output.view(record.group_size, -1)[dist.get_rank(record.group)]
            in_place.append(source.data_ptr() == row.data_ptr())

    used: dict[str, list[torch.Tensor]] = {"native": [], "broadcasts": []}
    for way, native_up_to in (("native", 1 << 30), ("broadcasts", 0)):
        default, comm.GLOO_NATIVE_ALL_GATHER_BYTES = comm.GLOO_NATIVE_ALL_GATHER_BYTES, native_up_to
        remove = comm.add_listener(check_input)
        try:
            model = _sharded(NOTHING_EXACT, reshard_after_forward=2)  # the backward re-gathers in pairs
            for module in model.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    module.register_forward_pre_hook(
                        lambda m, args, seen=used[way]: seen.append(m.weight.detach().clone())
                    )
            _loss(model, _batch(dist.get_rank())).backward()
        finally:
            remove()
            comm.GLOO_NATIVE_ALL_GATHER_BYTES = default  # (the bound also picks the reduce-scatter's way)
    assert in_place and all(in_place)
    assert len(used["native"]) == len(used["broadcasts"]) > 0
    assert all(torch.equal(a, b) for a, b in zip(used["native"], used["broadcasts"]))


@distributed(world_size=4)
def test_hybrid_mesh_quantizes_the_shard_group_gather():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    plain, _ = _gathered_bytes(_sharded(None, mesh=mesh))
    coded, dtypes = _gathered_bytes(_sharded(NOTHING_EXACT, mesh=mesh))
    assert dtypes == {torch.uint8}
    assert coded <= 0.3 * plain  # 1 byte (and a scale per block) instead of fp32's 4
    exact = torch.tensor(_train(_sharded(None, mesh=mesh)))
    torch.testing.assert_close(
        torch.tensor(_train(_sharded(AllGatherQuantization(), mesh=mesh))), exact, rtol=1e-2, atol=0
    )
    assert_computes_with_decoded_weights(_sharded(AllGatherQuantization(), mesh=mesh))


@distributed(world_size=2)
def test_wrapper_front_end():
    def wrapped(use_orig_params: bool = True) -> FullyShardedDataParallel:
        torch.manual_seed(0)
        policy = ModuleWrapPolicy({type(Transformer(ARGS).layers[0])})
        return FullyShardedDataParallel(Transformer(ARGS), auto_wrap_policy=policy, use_orig_params=use_orig_params)

    plain_model = wrapped()
    plain, _ = _gathered_bytes(plain_model)
    model = wrapped()
    set_all_gather_quantization(model, NOTHING_EXACT)
    coded, dtypes = _gathered_bytes(model)
    assert dtypes == {torch.uint8}
    assert coded <= 0.3 * plain
    # The default rule judges each parameter's own shape, not the wrapper's 1D shard of it: weights are coded.
    model = wrapped()
    set_all_gather_quantization(model, AllGatherQuantization())
    assert coded < _gathered_bytes(model)[0] < 0.5 * plain
    model = wrapped()
    set_all_gather_quantization(model, AllGatherQuantization())
    torch.testing.assert_close(torch.tensor(_train(model)), torch.tensor(_train(wrapped())), rtol=1e-2, atol=0)
    for use_orig_params in (True, False):
        model = wrapped(use_orig_params)
        set_all_gather_quantization(model, AllGatherQuantization())
        assert_computes_with_decoded_weights(model, built_second=True)


@distributed(world_size=2)
def test_bad_input():
    with pytest.raises(ValueError, match=r"^set_all_gather_quantization expects a module sharded .* but got Linear"):
        set_all_gather_quantization(nn.Linear(2, 2), AllGatherQuantization())
    with pytest.raises(ValueError, match=r"^quantized all-gather expects a code dtype in .* but got torch.float16$"):
        set_all_gather_quantization(_sharded(None), AllGatherQuantization(dtype=torch.float16))
    mixed = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double())
    fully_shard(mixed)
    with pytest.raises(NotImplementedError, match=r"with a unit of several dtypes \(Sequential holds torch.float32"):
        set_all_gather_quantization(mixed, AllGatherQuantization())
    with_subclass = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with_subclass[1].weight = nn.Parameter(Bf16Gathered(with_subclass[1].weight.detach()))
    fully_shard(with_subclass)
    with pytest.raises(NotImplementedError, match=r"with tensor-subclass parameters, .* \(Sequential holds 1.weight\)"):
        set_all_gather_quantization(with_subclass, AllGatherQuantization())


@distributed(world_size=2)
@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("bf16", [False, True])
def test_plan_counts_the_bytes_gathered(code: torch.dtype, bf16: bool):
    """``fullshard plan``'s all-gather bytes of a quantized gather are what the comm spy counts."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    model = _sharded(AllGatherQuantization(dtype=code), mp_policy=mp)  # the root kept from forward to backward
    measured, _ = _gathered_bytes(model)
    config = PlanConfig(ARGS, 2, "full", param_dtype=torch.bfloat16 if bf16 else None, all_gather_dtype=code)
    assert estimate(config).comm["all_gather"] == measured
