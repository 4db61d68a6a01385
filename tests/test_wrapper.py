"""The FSDP1-compatible wrapper: parity for every strategy, its members, and bad input."""

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from fullshard import (
    FSDP,
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    hybrid_mesh,
    set_all_gather_bucket_size,
)
from fullshard._core.layout import flat_pieces
from fullshard.models import MLP, ModelArgs, Transformer, TransformerBlock
from fullshard.testing import DataParallelReference, assert_params_equal, case, distributed, mean_over
from fullshard.wrap import ModuleWrapPolicy

CPU = torch.device("cpu")
ARGS = ModelArgs(n_layers=2, vocab_size=32, max_seq_len=8, dim=16)
BLOCKS = ModuleWrapPolicy({TransformerBlock})
HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


def make_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ARGS)


def batch_for(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(ARGS.vocab_size, (4, ARGS.max_seq_len), generator=generator)
    return tokens, tokens.roll(-1, dims=1)


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    tokens, targets = batch
    return F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())


def hybrid_groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    mesh = hybrid_mesh("cpu", num_devices_per_node=2)
    return mesh.get_group("shard"), mesh.get_group("replicate")


def torch_fsdp1(model: nn.Module, strategy: ShardingStrategy, use_orig_params: bool, mixed: bool, groups) -> nn.Module:
    """The same configuration in torch's FSDP1 (CPU offload left off: FSDP1 needs an accelerator for it)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    return TorchFSDP(
        model,
        sharding_strategy=TorchStrategy[strategy.name],
        auto_wrap_policy=TorchPolicy({TransformerBlock}),
        use_orig_params=use_orig_params,
        mixed_precision=TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None,
        process_group=groups,
        device_id=CPU,
    )


# (use_orig_params, offload, mixed) for each strategy: a row and its complement, so every strategy
# meets each flag both ways, and over the five pairs every two flags meet in all four combinations.
# The conformance matrix's "train" probe runs each strategy with every use_orig_params and mixed
# setting, and with offload, against torch's FSDP1 (tests/conformance/scenarios.py).
_FLAG_PAIRS = {
    ShardingStrategy.FULL_SHARD: (False, False, False),
    ShardingStrategy.SHARD_GRAD_OP: (True, True, False),
    ShardingStrategy.NO_SHARD: (True, False, True),
    ShardingStrategy.HYBRID_SHARD: (True, False, False),
    ShardingStrategy._HYBRID_SHARD_ZERO2: (False, True, True),
}
_PARITY_SETTINGS = [
    (strategy, *flags)
    for strategy, row in _FLAG_PAIRS.items()
    for flags in (row, tuple(not flag for flag in row))
]


@pytest.mark.parametrize("strategy,use_orig_params,offload,mixed", _PARITY_SETTINGS)
@distributed(world_size=4)
def test_parity_matrix(strategy, use_orig_params, offload, mixed):
    """5 AdamW steps against one process (``DataParallelReference``) and torch's FSDP1.

    Tolerances: fp32 1e-5 relative. With mixed precision (bf16 compute, fp32
    reduction) the reference reproduces the arithmetic on each rank's batch,
    so only summation order differs: 1e-4.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = hybrid_groups() if strategy in HYBRID else None
    ref = make_model()
    model = FSDP(
        copy.deepcopy(ref), sharding_strategy=strategy, auto_wrap_policy=BLOCKS, use_orig_params=use_orig_params,
        cpu_offload=CPUOffload(offload_params=offload), device_id=CPU, process_group=groups,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None,
    )
    oracle = torch_fsdp1(copy.deepcopy(ref), strategy, use_orig_params, mixed, groups)
    reference = DataParallelReference(ref, lm_loss, torch.bfloat16 if mixed else None)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (model, oracle, ref)]
    tolerance = dict(rtol=1e-4, atol=1e-5) if mixed else dict(rtol=1e-5, atol=1e-6)
    for step in range(5):
        losses = []
        for m in (model, oracle):
            loss = lm_loss(m, batch_for(rank, step))
            loss.backward()
            losses.append(mean_over(loss))
        ref_loss = reference.backward([batch_for(r, step) for r in range(world)])
        for optim in optims:
            optim.step()
            optim.zero_grad()
        torch.testing.assert_close(losses[0], ref_loss, **tolerance)
        torch.testing.assert_close(losses[0], losses[1], **tolerance)
    with FSDP.summon_full_params(model), type(oracle).summon_full_params(oracle):
        assert_params_equal(model, ref, match_names=False, **tolerance)
        # FSDP1 keeps its (now unsharded) flat parameters registered while summoned.
        theirs = [p for name, p in oracle.named_parameters() if "flat_param" not in name]
        assert len(theirs) == len(list(model.parameters()))
        for mine, other in zip(model.parameters(), theirs):
            torch.testing.assert_close(mine, other, **tolerance)


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("reentrant", [True, False])
@distributed(world_size=2)
def test_activation_checkpointing_applied_after_wrapping(reentrant, use_orig_params):
    """FSDP1's usual recipe: wrap, then ``apply_activation_checkpointing`` puts torch's
    ``checkpoint_wrapper`` inside each unit. Same training as one process and as torch's
    FSDP1 with the same recipe, and the recomputation re-gathers nothing."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    from fullshard._core import comm

    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    rank = dist.get_rank()
    ref = make_model()
    model, oracle = wrapped_pair(ref, use_orig_params)
    for m in (model, oracle):
        apply_activation_checkpointing(
            m, checkpoint_wrapper_fn=lambda block: checkpoint_wrapper(block, checkpoint_impl=impl),
            check_fn=lambda module: isinstance(module, TransformerBlock),
        )
    assert all(type(unit.module).__name__ == "CheckpointWrapper" for unit in FSDP.fsdp_modules(model)[1:])
    set_all_gather_bucket_size(model, 0)  # the count below is one gather per unit
    reference = DataParallelReference(ref, lm_loss)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (model, oracle, ref)]
    with comm.record_comms() as records:
        for step in range(3):
            losses = []
            for m in (model, oracle):
                loss = lm_loss(m, batch_for(rank, step))
                loss.backward()
                losses.append(mean_over(loss))
            ref_loss = reference.backward([batch_for(r, step) for r in range(2)])
            for optim in optims:
                optim.step()
                optim.zero_grad()
            torch.testing.assert_close(losses[0], ref_loss, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    # one all-gather for the root, two for each block (forward, backward): as without checkpointing
    assert sum(r.op == "all_gather" for r in records) == 3 * (1 + 2 * ARGS.n_layers)
    with FSDP.summon_full_params(model):
        assert_params_equal(model, ref, match_names=False)


def wrapped_pair(ref: nn.Module, use_orig_params: bool) -> tuple[nn.Module, nn.Module]:
    """``ref`` wrapped per block by this wrapper and by torch's FSDP1, fp32 FULL_SHARD."""
    mine = FSDP(copy.deepcopy(ref), auto_wrap_policy=BLOCKS, use_orig_params=use_orig_params, device_id=CPU)
    return mine, torch_fsdp1(copy.deepcopy(ref), ShardingStrategy.FULL_SHARD, use_orig_params, False, None)


# -- members ------------------------------------------------------------------------------------
def wrapped(**kwargs) -> tuple[nn.Module, Transformer]:
    ref = make_model()
    return FSDP(copy.deepcopy(ref), auto_wrap_policy=BLOCKS, device_id=CPU, **kwargs), ref


@distributed(world_size=2)
def test_module_process_group_and_fsdp_modules():
    model, ref = wrapped()
    assert isinstance(model.module, Transformer)
    assert model.process_group.size() == 2 and model._inter_node_pg is None
    units = FSDP.fsdp_modules(model)
    assert len(units) == 3 and units[0] is model
    assert FSDP.fsdp_modules(model, root_only=True) == [model]
    assert model.check_is_root() and not any(unit.check_is_root() for unit in units[1:])
    names = [name for name, _ in model.named_parameters()]
    assert names == [
        "_fsdp_wrapped_module._flat_param",
        "_fsdp_wrapped_module.layers.0._fsdp_wrapped_module._flat_param",
        "_fsdp_wrapped_module.layers.1._fsdp_wrapped_module._flat_param",
    ]
    # Outside forward the original attributes show this rank's pieces of the flat shard (not as parameters).
    block = dict(ref.layers[0].named_parameters())
    _, pieces = flat_pieces([p.numel() for p in block.values()], 2)
    start, stop = pieces[list(block).index("attention.wq.weight")][dist.get_rank()]
    shown = model.module.layers[0].module.attention.wq.weight
    assert not isinstance(shown, nn.Parameter) and shown.shape == (stop - start,)
    torch.testing.assert_close(shown, ref.layers[0].attention.wq.weight.detach().reshape(-1)[start:stop])


@pytest.mark.parametrize("use_orig_params", [False, True])
@distributed(world_size=2)
def test_no_sync_accumulates_without_communication(use_orig_params):
    from fullshard._core import comm

    model, ref = wrapped(use_orig_params=use_orig_params)
    reference = DataParallelReference(ref, lm_loss)
    rank = dist.get_rank()
    with comm.record_comms() as records:
        with model.no_sync():
            (lm_loss(model, batch_for(rank, 0)) / 2).backward()
        (lm_loss(model, batch_for(rank, 1)) / 2).backward()
    assert sum(r.op == "reduce_scatter" for r in records) == 3  # only the last backward reduces
    for step in (0, 1):
        reference.backward([tuple(t for t in batch_for(r, step)) for r in range(2)], num_microbatches=1)
    for param in ref.parameters():
        param.grad /= 2
    with FSDP.summon_full_params(model, with_grads=True):
        assert_params_equal(model, ref, grads=True, match_names=False)


@pytest.mark.parametrize("use_orig_params", [False, True])
@distributed(world_size=2)
def test_summon_full_params(use_orig_params):
    ref = make_model()
    ref.layers[0].register_buffer("mask", torch.ones(4))  # inside a unit: prefixed twice
    model = FSDP(copy.deepcopy(ref), auto_wrap_policy=BLOCKS, device_id=CPU, use_orig_params=use_orig_params)
    expected = dict(ref.named_parameters())
    assert any(name.startswith("_fsdp_wrapped_module.") for name, _ in model.named_buffers())
    with FSDP.summon_full_params(model):
        names = [name for name, _ in model.named_parameters()]
        assert names == list(expected)  # clean names, no flat parameters
        assert [name for name, _ in model.named_buffers()] == [name for name, _ in ref.named_buffers()]
        for name, param in model.named_parameters():
            torch.testing.assert_close(param, expected[name])
        with torch.no_grad():
            model.module.norm.weight.add_(1.0)  # written back on exit
    with FSDP.summon_full_params(model, writeback=False):
        torch.testing.assert_close(model.module.norm.weight, expected["norm.weight"] + 1.0)
        with torch.no_grad():
            model.module.norm.weight.add_(1.0)  # dropped on exit
    with FSDP.summon_full_params(model, rank0_only=True, writeback=False, offload_to_cpu=True):
        weight = model.module.norm.weight
        if dist.get_rank() == 0:
            torch.testing.assert_close(weight, expected["norm.weight"] + 1.0)
        else:
            assert _local_numel(weight) == _shard_numel(model, "norm.weight")  # rank 1 keeps its shard
    with FSDP.summon_full_params(model.module.layers[0], recurse=False):
        assert model.module.layers[0].module.attention.wq.weight.shape == (16, 16)
        assert _local_numel(model.module.norm.weight) == _shard_numel(model, "norm.weight")  # the root stayed sharded
    with pytest.raises(NotImplementedError, match="rank0_only=True is not yet supported with writeback=True"):
        with FSDP.summon_full_params(model, rank0_only=True):
            pass


def _shard_numel(model: FSDP, fqn: str) -> int:
    """Elements of ``fqn`` in this rank's shard of ``model``'s unit: its rows (use_orig_params=True),
    its piece of FSDP1's flat shard (use_orig_params=False)."""
    params = model._state.group.spec.params
    if model.use_orig_params:
        return next(p for p in params if p.fqn == fqn).shard_numel
    index = [p.fqn for p in params].index(fqn)
    _, pieces = flat_pieces([p.num_rows * p.row_numel for p in params], 2)
    start, stop = pieces[index][dist.get_rank()]
    return stop - start


def _local_numel(tensor: torch.Tensor) -> int:
    """Elements this rank holds: a DTensor shard (flat parameters' attributes) or a
    plain 1D shard view (use_orig_params=True, see test_wrapper_param_contract.py)."""
    return tensor.to_local().numel() if isinstance(tensor, DTensor) else tensor.numel()


def _reinitialise(module: nn.Module) -> None:
    """What FSDP1 users pass to ``model.apply``: needs the full (2D) weights."""
    if isinstance(module, nn.Linear):
        assert module.weight.shape == (module.out_features, module.in_features)
        nn.init.eye_(module.weight)


@pytest.mark.parametrize("use_orig_params", [False, True])
@distributed(world_size=2)
def test_apply_sees_full_parameters_and_writes_them_back(use_orig_params):
    model, ref = wrapped(use_orig_params=use_orig_params)
    assert model.apply(_reinitialise) is model
    ref.apply(_reinitialise)
    with FSDP.summon_full_params(model):
        for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(param, ref_param, msg=lambda m: f"{name}: {m}")
    optims = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref)]
    reference = DataParallelReference(ref, lm_loss)
    for step in range(2):  # the written-back shards train like the reference
        lm_loss(model, batch_for(dist.get_rank(), step)).backward()
        reference.backward([batch_for(r, step) for r in range(2)])
        for optim in optims:
            optim.step()
            optim.zero_grad()
    with FSDP.summon_full_params(model):
        for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(param, ref_param, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@distributed(world_size=2)
def test_optim_state_dict_arguments_it_cannot_honour():
    model, _ = wrapped(use_orig_params=True)
    optim = torch.optim.Adam(model.parameters())
    other_group = dist.new_group(list(range(dist.get_world_size())))  # the model's own group is not warned of
    with pytest.warns(UserWarning, match="FSDP.optim_state_dict ignores group"):
        osd = FSDP.optim_state_dict(model, optim, group=other_group)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FSDP.optim_state_dict(model, optim, group=model.process_group)  # as torch's state-dict API passes it
    with pytest.raises(NotImplementedError, match="not NamedOptimizer"):
        FSDP.optim_state_dict_to_load(model, optim, osd, is_named_optimizer=True)


@distributed(world_size=2)
def test_summon_full_params_with_grads_and_during_forward_error():
    model, ref = wrapped(use_orig_params=True)
    reference = DataParallelReference(ref, lm_loss)
    lm_loss(model, batch_for(dist.get_rank(), 0)).backward()
    reference.backward([batch_for(r, 0) for r in range(2)])
    with FSDP.summon_full_params(model, with_grads=True):
        assert_params_equal(model, ref, grads=True, match_names=False)

    def summon_inside(module, args):
        with FSDP.summon_full_params(module):
            pass

    model.module.layers[1].register_forward_pre_hook(summon_inside)
    with pytest.raises(AssertionError, match="expects no forward or backward in progress"):
        lm_loss(model, batch_for(0, 0))


@distributed(world_size=2)
def test_sync_module_states():
    torch.manual_seed(dist.get_rank())  # every rank starts from different values
    model = FSDP(MLP(8, with_buffer=True), sync_module_states=True, use_orig_params=True, device_id=CPU)
    with FSDP.summon_full_params(model):
        for tensor in [*model.parameters(), *model.buffers()]:
            gathered = [torch.empty_like(tensor) for _ in range(2)]
            dist.all_gather(gathered, tensor.detach().contiguous())
            torch.testing.assert_close(gathered[0], gathered[1])


@distributed(world_size=2)
def test_meta_device_init():
    with torch.device("meta"):
        default = MLP(8)
        custom = MLP(8)

    def init_to_ones(module: nn.Module) -> None:
        module.to_empty(device=CPU)
        for param in module.parameters():
            nn.init.ones_(param)

    default = FSDP(default, device_id=CPU, use_orig_params=True)  # to_empty + reset_parameters
    custom = FSDP(custom, device_id=CPU, param_init_fn=init_to_ones, use_orig_params=True)
    with FSDP.summon_full_params(default), FSDP.summon_full_params(custom):
        assert not default.in_proj.weight.is_meta and default.in_proj.weight.abs().sum() > 0
        assert (custom.in_proj.weight == 1).all()
    default(torch.ones(2, 8)).sum().backward()


@distributed(world_size=2)
def test_ignored_modules_and_states():
    torch.manual_seed(0)
    model = nn.Sequential(MLP(4), MLP(4))
    numel = sum(p.numel() for p in model[1].parameters())
    wrapper = FSDP(model, ignored_modules=[model[0]], device_id=CPU)
    assert all(not hasattr(p, "placements") for p in model[0].parameters())  # untouched, full
    flat = [p for name, p in wrapper.named_parameters() if name.endswith("_flat_param")]
    assert len(flat) == 1, [name for name, _ in wrapper.named_parameters()]
    assert flat[0].numel() == numel // 2  # model[1] only, every dim even: no padding
    torch.manual_seed(0)
    model = nn.Sequential(MLP(4), MLP(4))
    ignored_weight = model[1].out_proj.weight
    wrapper = FSDP(model, ignored_states=[ignored_weight], use_orig_params=True, device_id=CPU)
    assert model[1].out_proj.weight is ignored_weight and not hasattr(ignored_weight, "placements")
    wrapper(torch.ones(2, 4) * (dist.get_rank() + 1)).sum().backward()
    grads = [torch.empty_like(ignored_weight.grad) for _ in range(2)]
    dist.all_gather(grads, ignored_weight.grad)
    assert not torch.equal(grads[0], grads[1])  # not reduced


@pytest.mark.parametrize(
    "backward_prefetch,forward_prefetch",
    [(None, False), (BackwardPrefetch.BACKWARD_POST, False), (BackwardPrefetch.BACKWARD_PRE, True)],
)
@distributed(world_size=2)
def test_prefetch_settings_keep_parity(backward_prefetch, forward_prefetch):
    model, ref = wrapped(backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch)
    reference = DataParallelReference(ref, lm_loss)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    for step in range(3):
        loss = mean_over(lm_loss(model, batch_for(dist.get_rank(), step)))
        lm_loss(model, batch_for(dist.get_rank(), step)).backward()
        ref_loss = reference.backward([batch_for(r, step) for r in range(2)])
        for optim in optims:
            optim.step()
            optim.zero_grad()
        torch.testing.assert_close(loss, ref_loss)


@distributed(world_size=2)
def test_keep_low_precision_grads_and_buffer_dtype():
    precision = MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16,
        keep_low_precision_grads=True,
    )
    model = FSDP(MLP(4, with_buffer=True), mixed_precision=precision, device_id=CPU)
    assert model.module.buffer.dtype == torch.bfloat16
    model(torch.ones(2, 4)).float().sum().backward()  # the root casts its inputs to bf16
    flat = next(model.parameters())
    assert flat.dtype == torch.float32 and flat.grad.dtype == torch.bfloat16


@distributed(world_size=2)
def test_flat_parameter_needs_uniform_dtype_and_requires_grad():
    model = MLP(4)
    model.in_proj.weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"share requires_grad, but MLP has frozen \['in_proj.weight'\]"):
        FSDP(model, device_id=CPU)
    model = MLP(4)
    model.out_proj.bias.data = model.out_proj.bias.data.double()
    with pytest.raises(ValueError, match=r"use_orig_params=False expects one dtype per unit.*torch.float64"):
        FSDP(model, device_id=CPU)
    # use_orig_params=True supports both.
    torch.manual_seed(0)
    ref = MLP(4)
    ref.in_proj.weight.requires_grad_(False)
    model = FSDP(copy.deepcopy(ref), device_id=CPU, use_orig_params=True)
    reference = DataParallelReference(ref, lambda m, b: m(b[0]).square().mean())
    optims = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.1) for m in (model, ref)]
    for step in range(3):
        batches = [(torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * step + r)),) for r in range(2)]
        model(batches[dist.get_rank()][0]).square().mean().backward()
        reference.backward(batches)
        for optim in optims:
            optim.step()
            optim.zero_grad()
    with FSDP.summon_full_params(model):
        assert_params_equal(model, ref, match_names=False)


# -- bad input ----------------------------------------------------------------------------------
def _hybrid_groups_not_covering_the_world() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    rank = dist.get_rank()
    # new_group is collective: every rank creates every group, then picks its own.
    nodes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    uneven = [dist.new_group([0, 1, 2]), dist.new_group([3])]
    return nodes[rank // 2], uneven[0] if rank < 3 else uneven[1]


def _same_group_twice() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    nodes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    same = nodes[dist.get_rank() // 2]
    return same, same


def _with_scalar() -> MLP:
    model = MLP(4)
    model.scale = nn.Parameter(torch.tensor(1.0))
    return model


# One behaviour per row: (exception type, message pattern, the call that must raise it). The rows
# share one distributed body (one task of the rank pool): as one task per row, the rows that make new
# groups and raise left the pool's next task failing in gloo's connectFullMesh ("Connection closed
# by peer"), and each task costs a rendezvous.
BAD_INPUT = {
    "not_a_module": (
        TypeError, r"^FullyShardedDataParallel expects an nn.Module but got Tensor$",
        lambda: FSDP(torch.ones(2))),
    "hybrid_groups_not_covering_the_world": (
        ValueError, r"sizes multiply to the world size 4, but got sizes",
        lambda: FSDP(MLP(4), sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_id=CPU,
                     process_group=_hybrid_groups_not_covering_the_world())),
    "hybrid_groups_identical": (
        ValueError, r"to share exactly this rank",
        lambda: FSDP(MLP(4), sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_id=CPU,
                     process_group=_same_group_twice())),
    "process_group_and_device_mesh": (
        ValueError, r"Cannot pass both process_group and device_mesh",
        lambda: FSDP(MLP(4), process_group=dist.group.WORLD, device_mesh=hybrid_mesh("cpu", 2), device_id=CPU)),
    "rewrap_with_another_strategy": (
        ValueError, r"wrapped with FULL_SHARD and SHARD_GRAD_OP was requested",
        lambda: FSDP(FSDP(MLP(4), device_id=CPU), sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, device_id=CPU)),
    # As torch's FSDP1: ValueError (tests/test_fully_shard_errors.py has the oracle); the wrapper's
    # argument, not fully_shard's.
    "scalar_parameter": (
        ValueError, r"^FullyShardedDataParallel expects parameters with at least one dimension but got the 0-dim "
        r"scale of MLP; reshape it to \(1,\) or pass it in ignored_states$",
        lambda: FSDP(_with_scalar(), device_id=CPU)),
    "group_pair_without_hybrid": (
        ValueError, r"SHARD_GRAD_OP expects one process group; a \(shard, replicate\) pair",
        lambda: FSDP(MLP(4), sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, device_id=CPU,
                     process_group=_same_group_twice())),
}


@distributed(world_size=4)
def test_bad_input():
    for name, (error, match, call) in BAD_INPUT.items():
        with case(name), pytest.raises(error, match=match):
            call()
