"""ShardedGradScaler: seed 004 counterparts, every rank skipping together, and bad input.

The seed's fp16 settings run as they are: torch 2.13's CPU kernels cover fp16
Linear/Transformer forward and backward, fp16 autocast, the unscale and
scale-update kernels, fp16 sparse coalescing and gloo fp16 reductions.
"""

import copy
import functools
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel as DDP

from fullshard import (
    FSDP,
    CPUOffload,
    MixedPrecision,
    ShardedGradScaler,
    ShardingStrategy,
)
from fullshard._core import comm
from fullshard.testing import distributed
from fullshard.testing.fake_group import FakeSingleRankGroup
from fullshard.testing.models import TransformerWithSharedParams
from fullshard.testing.nested_models import NestedWrappedModule, NonUniformReqGradNWM
from fullshard.wrap import ModuleWrapPolicy

CPU = torch.device("cpu")
INF = float("inf")


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ReturnsMarker(torch.optim.SGD):
    """SGD whose step returns a marker, so that a skipped step's None is visible."""

    def step(self, closure=None):
        super().step(closure)
        return "stepped"


# -- single process (seed: TestShardGradScaler) ---------------------------------------------
def test_grad_scaling():
    scaler = ShardedGradScaler(init_scale=2.0, process_group=FakeSingleRankGroup(), enabled=True)
    assert scaler.is_enabled()  # device="cuda" on a CPU-only machine does not switch it off
    t0 = torch.full((1,), 4.0, dtype=torch.float32, device="cpu")
    t1 = torch.full((1,), 8.0, dtype=torch.float32, device="cpu")
    outputs = [t1.clone(), (t0.clone(), t1.clone()), [t0.clone(), t1.clone()]]
    outputs = scaler.scale(outputs)
    assert isinstance(outputs, list) and isinstance(outputs[1], tuple) and isinstance(outputs[2], list)
    assert outputs[0] == 16.0 and outputs[1][0] == 8.0 and outputs[1][1] == 16.0
    assert outputs[2][0] == 8.0 and outputs[2][1] == 16.0
    assert scaler._scale.device == t1.device
    # A low-precision 0-dim loss (FSDP mixed precision) keeps its dtype.
    half_loss = torch.tensor(3.0, dtype=torch.float16)
    assert scaler.scale(half_loss).dtype == torch.float16 and scaler.scale(half_loss) == 6.0
    assert list(scaler.scale(iter([t0]))) == [8.0]
    with pytest.raises(ValueError, match=r"^ShardedGradScaler.scale expects a tensor or an iterable of tensors but got float$"):
        scaler.scale([t0, 1.0])


def test_scaling_unscaling_sparse():
    scaler = ShardedGradScaler(init_scale=2.0, process_group=FakeSingleRankGroup(), enabled=True)
    inv_scale = torch.full((1,), 0.5, dtype=torch.float, device="cpu")
    found_inf = torch.full((1,), 0, dtype=torch.float, device="cpu")

    i = torch.tensor([[0, 1, 1], [2, 0, 2]], device="cpu", dtype=torch.int64)
    v = torch.tensor([16.0, 32.0, 64.0], dtype=torch.float, device="cpu")
    s = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device="cpu", dtype=torch.float, check_invariants=True)
    s1 = s.clone()
    s1.grad = s.clone()
    opt = torch.optim.SGD([s1], lr=1.0)
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf)[s1.device]
    assert found_inf == 0.0
    torch.testing.assert_close(s1.grad.to_dense(), (s / 2).to_dense())

    v = torch.tensor([16.0, 32.0, INF], dtype=torch.float, device="cpu")
    s1.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device="cpu", dtype=torch.float, check_invariants=True)
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf)[s1.device]
    assert found_inf == 1.0

    # fp16 values that overflow only once duplicate indices are added up. The
    # seed keeps the old optimizer here (whose gradient still holds the inf of
    # the previous case); we do that too, then check with a fresh optimizer over
    # the fp16 tensor, where only the coalesced sum can be infinite.
    i = torch.tensor([[1, 1, 1], [0, 0, 2]], device="cpu", dtype=torch.int64)
    v = torch.tensor([2**15, 2**15, 1.0], dtype=torch.float16, device="cpu")
    s1 = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device="cpu", dtype=torch.float16, check_invariants=True)
    s1.grad = s1.clone()
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf)[s1.device]
    assert found_inf == 1.0
    fresh = torch.optim.SGD([s1], lr=1.0)
    assert torch.isfinite(s1.grad._values()).all()
    found_inf = scaler._unscale_grads_(fresh, inv_scale, torch.zeros(1))[s1.device]
    assert found_inf == 1.0
    assert s1.grad.is_coalesced() and s1.grad.dtype == torch.float16
    assert s1.grad._values().tolist() == [INF, 0.5]


def test_inf_gradients_skip_optim_step():
    scaler = ShardedGradScaler(init_scale=2.0, process_group=FakeSingleRankGroup(), enabled=True)
    loss = torch.full((1,), 4.0, dtype=torch.float32, device="cpu")
    t0 = torch.tensor([INF], dtype=torch.float32, device="cpu")
    t0.grad = t0.clone()
    opt = ReturnsMarker([t0], lr=1.0)
    scaler.scale(loss)
    ret_val = scaler.step(opt)
    assert ret_val is None
    assert t0.item() == INF  # an SGD step would have made it inf - inf = nan
    scaler.update()
    assert scaler.get_scale() == 1.0
    # A clean step runs the optimizer and returns what its step returns.
    t0.data.fill_(1.0)
    t0.grad = torch.tensor([2.0])
    assert scaler.step(opt) == "stepped"
    assert t0.item() == 1.0 - 2.0  # the gradient was divided by the scale 1.0


def scripted_run(scaler, grads: list[float]) -> list[tuple[float, int, float]]:
    """Steps one parameter through ``grads`` (inf = an overflowing step); returns
    (scale, growth tracker, parameter) after each update."""
    param = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    history = []
    for value in grads:
        scaled = scaler.scale(torch.tensor(1.0))
        param.grad = torch.full((2,), value) * scaled.detach()
        scaler.step(opt)
        scaler.update()
        history.append((scaler.get_scale(), scaler._get_growth_tracker(), param[0].item()))
    return history


def test_update_grows_and_backs_off_like_grad_scaler():
    grads = [1.0, 1.0, 1.0, INF, 1.0, float("nan"), 1.0, 1.0, 1.0]
    settings = dict(init_scale=8.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=2)
    ours = scripted_run(ShardedGradScaler(**settings), grads)
    theirs = scripted_run(torch.amp.GradScaler("cpu", **settings), grads)
    assert ours == theirs
    assert [s for s, _, _ in ours] == [8.0, 32.0, 32.0, 8.0, 8.0, 2.0, 2.0, 8.0, 8.0]
    scaler = ShardedGradScaler(init_scale=4.0)
    scripted_run(scaler, [1.0])
    scaler.update(new_scale=torch.tensor(64.0))  # a CPU tensor although device="cuda"
    assert scaler.get_scale() == 64.0
    scaler.update(new_scale=2.0)
    assert scaler.get_scale() == 2.0


def test_state_dict_round_trip():
    grads = [1.0, INF, 1.0]
    settings = dict(init_scale=16.0, growth_interval=3)
    scaler = ShardedGradScaler(**settings)
    scripted_run(scaler, grads)
    oracle = torch.amp.GradScaler("cpu", **settings)
    scripted_run(oracle, grads)
    state = scaler.state_dict()
    assert state == oracle.state_dict()
    assert state["scale"] == 8.0 and state["_growth_tracker"] == 1
    restored = ShardedGradScaler(init_scale=1.0, growth_interval=100)
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    assert restored.scale(torch.tensor(1.0)) == 8.0
    # Both continue identically: two more clean steps reach the interval of 3.
    assert scripted_run(restored, [1.0, 1.0]) == scripted_run(scaler, [1.0, 1.0])
    assert restored.get_scale() == 16.0
    disabled = ShardedGradScaler(enabled=False)
    assert disabled.state_dict() == {}
    with pytest.raises(RuntimeError, match="state dict is empty"):
        restored.load_state_dict({})


def test_disabled_scaler_is_a_pass_through():
    scaler = ShardedGradScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss
    param = nn.Parameter(torch.ones(1))
    param.grad = torch.ones(1)
    assert scaler.step(ReturnsMarker([param], lr=1.0)) == "stepped"
    assert param.item() == 0.0


def test_misuse_raises():
    param = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([param], lr=1.0)
    scaler = ShardedGradScaler(init_scale=2.0)
    scaler.scale(torch.tensor(1.0))
    param.grad = torch.ones(1)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called on this optimizer since the last update\(\)"):
        scaler.unscale_(opt)
    assert param.grad.item() == 0.5  # not unscaled twice
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called since the last update\(\)"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"expects one call per optimizer .* but step\(\) was called"):
        scaler.unscale_(opt)
    scaler.update()
    scaler.unscale_(opt)  # a new step may unscale again


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the scale on the GPU, gradients on the CPU")
def test_offloaded_gradients_with_scale_on_cuda():
    scaler = ShardedGradScaler(init_scale=4.0, process_group=FakeSingleRankGroup())
    params = [nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, device="cuda"))]
    opt = torch.optim.SGD(params, lr=1.0)
    scaler.scale(torch.tensor(1.0, device="cuda"))
    assert scaler._scale.device.type == "cuda"
    params[0].grad, params[1].grad = torch.full((2,), 4.0), torch.full((2,), 8.0, device="cuda")
    scaler.unscale_(opt)
    assert params[0].grad.tolist() == [1.0, 1.0] and params[1].grad.tolist() == [2.0, 2.0]
    assert list(scaler._found_inf_per_device(opt)) == [scaler._scale.device]
    scaler.step(opt)
    scaler.update()
    params[0].grad = torch.tensor([INF, 0.0])  # the inf is on the CPU only
    params[1].grad = torch.zeros(2, device="cuda")
    assert scaler.step(opt) is None and params[0].tolist() == [0.0, 0.0]
    scaler.update()
    assert scaler.get_scale() == 2.0


# -- parity with DDP + torch.amp.GradScaler (seed: test_fsdp_ddp_parity_with_grad_scaler) ---
PARITY_MATRIX = list(itertools.product([True, False], [ShardingStrategy.SHARD_GRAD_OP, None], [True, False], [True, False]))
NUM_PARITY_STEPS = 8


def train_with_scaler(model, scaler, rank: int, autocast: bool, loss_dtype: torch.dtype):
    """The seed's training loop: SGD with momentum (Adam would hide a wrong scale)."""
    optim = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    losses, scales = [], []
    for _ in range(NUM_PARITY_STEPS):
        optim.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            inputs = model.module.get_input(rank)
            if autocast:
                inputs = tuple(x.half() for x in inputs)
            loss = model.module.get_loss(inputs, model(*inputs))
        scaled = scaler.scale(loss)
        assert scaled.dtype == loss_dtype, f"{type(model).__name__}: scaled loss in {scaled.dtype}"
        scaled.backward()
        scaler.step(optim)
        scaler.update()
        losses.append(loss.detach().float())
        scales.append(scaler.get_scale())
    return torch.stack(losses), scales


@pytest.mark.parametrize(
    "offload,strategy,mixed,use_orig_params", PARITY_MATRIX,
    ids=[f"offload{o}-{s.name if s else 'FULL_SHARD'}-mp{m}-orig{u}" for o, s, m, u in PARITY_MATRIX],
)
@distributed(world_size=2)
def test_fsdp_ddp_parity_with_grad_scaler(offload, strategy, mixed, use_orig_params):
    """Our wrapper + ShardedGradScaler against DDP + torch.amp.GradScaler, 8 steps.

    As in the seed: NestedWrappedModule with flat parameters, NonUniformReqGradNWM
    (``init_scale=2**11``) with ``use_orig_params``; mixed precision is fp16
    parameters, reduction and buffers against DDP under fp16 autocast; losses
    are compared at every step (the seed: the last one) with fp16's tolerance
    under mixed precision, the scale after every step (the same steps skipped),
    and full-precision parameters at the end. With fp16 the default scale
    overflows for the first 3 steps; at least half of the steps must be taken
    (else equal losses would prove nothing). The seed's device-init modes
    collapse on CPU (CUDA_NEVER equals CUDA_BEFORE, and offloading with
    CUDA_AFTER raises only on a GPU); we run "before" and "after" (``.to()`` the
    wrapped model).
    """
    rank = dist.get_rank()
    model_cls = NonUniformReqGradNWM if use_orig_params else NestedWrappedModule
    scaler_kwargs = {"init_scale": 2.0**11} if use_orig_params else {}
    precision = MixedPrecision(torch.float16, torch.float16, torch.float16) if mixed else None
    base = model_cls()
    ref = DDP(copy.deepcopy(base))
    ref_losses, ref_scales = train_with_scaler(
        ref, torch.amp.GradScaler("cpu", **scaler_kwargs), rank, autocast=mixed, loss_dtype=torch.float32
    )
    init_scales = [scaler_kwargs.get("init_scale", 2.0**16)] + ref_scales[:-1]
    assert sum(after == before for after, before in zip(ref_scales, init_scales)) >= NUM_PARITY_STEPS // 2
    fsdp_kwargs = dict(
        cpu_offload=CPUOffload(offload_params=offload), sharding_strategy=strategy, mixed_precision=precision,
        use_orig_params=use_orig_params,
    )
    for init_mode in ("before", "after"):
        model = FSDP(copy.deepcopy(base).wrap_units(functools.partial(FSDP, **fsdp_kwargs)), **fsdp_kwargs)
        if init_mode == "after":
            model = model.to(CPU)
        low = torch.float16 if mixed else torch.float32
        with comm.record_comms() as records:
            losses, scales = train_with_scaler(model, ShardedGradScaler(**scaler_kwargs), rank, False, low)
        assert {r.dtype for r in records if r.op in ("all_gather", "reduce_scatter")} == {low}
        assert scales == ref_scales, f"{init_mode}: scales {scales} vs DDP {ref_scales}"
        tolerance = dict(rtol=1e-3, atol=1e-3) if mixed else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(losses, ref_losses, **tolerance)
        if not mixed:
            with FSDP.summon_full_params(model):
                mine = dict(model.named_parameters())
                for name, param in ref.module.named_parameters():
                    torch.testing.assert_close(mine[name], param, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


# -- one rank's inf skips every rank's step (seed: test_sharded_grad_scaler_found_inf) --------
LAYERS = ModuleWrapPolicy({nn.TransformerEncoderLayer, nn.TransformerDecoderLayer})


@pytest.mark.parametrize("use_orig_params,offload", list(itertools.product([False, True], [True, False])))
@distributed(world_size=2)
def test_sharded_grad_scaler_found_inf(use_orig_params, offload):
    """10 Adam steps of the transformer next to DDP + GradScaler (both ``init_scale=2``);
    on even steps rank 0 alone fills one local gradient with inf (DDP: every
    rank, since its gradients are replicated). Every rank must skip, keep its
    parameters and halve the scale, with one float32 all-reduce per step and no
    other collective (``CommDebugMode`` also sees DTensor's own);
    scaled losses match DDP at every step (the seed compares the first only).
    """
    rank = dist.get_rank()
    base = TransformerWithSharedParams()
    ref = DDP(copy.deepcopy(base))
    model = FSDP(copy.deepcopy(base), use_orig_params=use_orig_params, auto_wrap_policy=LAYERS,
                 cpu_offload=CPUOffload(offload_params=offload))
    runs = [
        (ref, torch.optim.Adam(ref.parameters(), lr=1e-2), torch.amp.GradScaler("cpu", init_scale=2.0)),
        (model, torch.optim.Adam(model.parameters(), lr=1e-2), ShardedGradScaler(init_scale=2.0)),
    ]
    for step in range(10):
        inputs = base.get_input(seed=1000 * step + rank)
        should_find_inf = step % 2 == 0
        scaled_losses = []
        for m, optim, scaler in runs:
            optim.zero_grad()
            scaled = scaler.scale(TransformerWithSharedParams.get_loss(inputs, m(*inputs)))
            scaled_losses.append(scaled.detach())
            scaled.backward()
            with_grads = [p for p in m.parameters() if p.grad is not None]
            before = [local(p).detach().clone() for p in with_grads]
            if should_find_inf and (m is ref or rank == 0):
                with_grads[0].grad.fill_(INF)
            if m is model and rank == 1:
                assert all(torch.isfinite(local(p.grad)).all() for p in with_grads)
            with comm.record_comms() as records, CommDebugMode() as everything:
                scaler.step(optim)
            if m is model:
                assert [(r.op, r.dtype) for r in records] == [("all_reduce", torch.float32)]
                assert everything.get_total_counts() == 1  # no collective outside comm.py (DTensor's own)
            old_scale = scaler.get_scale()
            scaler.update()
            expected = old_scale * scaler.get_backoff_factor() if should_find_inf else old_scale
            assert scaler.get_scale() == expected, f"rank {rank} step {step}: {scaler.get_scale()} vs {expected}"
            for param, old in zip(with_grads, before):
                if should_find_inf:
                    assert torch.equal(local(param), old), f"rank {rank} step {step}: stepped despite an inf"
                elif old.numel() > 0:
                    assert not torch.equal(local(param), old), f"rank {rank} step {step}: did not step"
        torch.testing.assert_close(scaled_losses[1], scaled_losses[0], rtol=1e-4, atol=1e-4)


# -- more cross-rank cases ---------------------------------------------------------------------
def small_fsdp(use_orig_params: bool) -> nn.Module:
    torch.manual_seed(0)
    return FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), use_orig_params=use_orig_params, device_id=CPU)


def one_step(model, optim, scaler, rank: int):
    optim.zero_grad()
    inputs = torch.rand(2, 4, generator=torch.Generator().manual_seed(rank))
    scaler.scale(model(inputs).sum()).backward()


@pytest.mark.parametrize("use_orig_params", [False, True])
@distributed(world_size=2)
def test_inf_injected_through_comm_spy(use_orig_params):
    """Rank 1 puts an inf into the part of its reduce-scatter input that rank 0
    receives: only rank 0's shard overflows, and rank 1 skips because of the
    flag's all-reduce."""
    rank = dist.get_rank()
    model = small_fsdp(use_orig_params)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(init_scale=4.0)

    def poison(record, tensors):
        if record.op == "reduce_scatter" and rank == 1:
            tensors[1].view(record.group_size, -1)[0, 0] = INF

    remove = comm.add_listener(poison)
    try:
        one_step(model, optim, scaler, rank)
    finally:
        remove()
    grads = [local(p.grad) for p in model.parameters()]
    assert any(not torch.isfinite(g).all() for g in grads) == (rank == 0)
    before = [local(p).clone() for p in model.parameters()]
    assert scaler.step(optim) is None
    scaler.update()
    assert scaler.get_scale() == 2.0
    assert all(torch.equal(local(p), b) for p, b in zip(model.parameters(), before))
    one_step(model, optim, scaler, rank)  # clean: every rank steps
    scaler.step(optim)
    scaler.update()
    assert scaler.get_scale() == 2.0
    assert not all(torch.equal(local(p), b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("use_orig_params", [False, True])
@distributed(world_size=2)
def test_rank_without_gradients_joins_the_decision(use_orig_params):
    """``Linear(4, 1)``'s one row lives on rank 0: rank 1 holds no element of any
    trainable parameter but must still join the all-reduce and skip with rank 0.
    (The seed's NonUniformReqGradNWM gets this from FSDP1's flat layout.)"""
    rank = dist.get_rank()
    torch.manual_seed(0)
    frozen_first = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    frozen_first[0].requires_grad_(False)
    wrap = functools.partial(FSDP, use_orig_params=use_orig_params, device_id=CPU)
    frozen_first[0] = wrap(frozen_first[0])
    model = wrap(frozen_first)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.SGD(trainable, lr=0.1)
    scaler = ShardedGradScaler(init_scale=4.0)
    if use_orig_params and rank == 1:
        assert all(local(p).numel() == 0 for p in trainable)
    for poison in (True, False):
        one_step(model, optim, scaler, rank)
        if poison and rank == 0:
            next(p for p in trainable if local(p).numel()).grad.fill_(INF)
        before = [local(p).detach().clone() for p in trainable]
        with comm.record_comms() as records:
            scaler.step(optim)
        scaler.update()
        assert [r.op for r in records] == ["all_reduce"]
        assert scaler.get_scale() == 2.0  # halved once, then kept
        if rank == 0:
            changed = any(not torch.equal(local(p), b) for p, b in zip(trainable, before))
            assert changed == (not poison)


@distributed(world_size=2)
def test_fused_optimizer_skips_on_every_rank():
    """Fused Adam unscales inside its own step: ``step`` takes GradScaler's
    ``_check_inf_per_device`` path, whose flag must be agreed on too."""
    rank = dist.get_rank()
    model = small_fsdp(use_orig_params=False)
    optim = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    scaler = ShardedGradScaler(init_scale=4.0)
    one_step(model, optim, scaler, rank)
    if rank == 0:
        next(model.parameters()).grad.fill_(INF)
    before = [p.detach().clone() for p in model.parameters()]
    with comm.record_comms() as records:
        scaler.step(optim)
    scaler.update()
    assert [r.op for r in records] == ["all_reduce"]
    assert scaler.get_scale() == 2.0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), f"rank {rank} stepped"
    one_step(model, optim, scaler, rank)
    scaler.step(optim)
    scaler.update()
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# -- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("use_orig_params", [False, True])
@distributed(world_size=2)
def test_process_group_must_hold_the_parameters(use_orig_params):
    rank = dist.get_rank()
    singles = [dist.new_group([0]), dist.new_group([1])]  # new_group is collective: every rank makes both
    with pytest.raises(ValueError, match=rf"^ShardedGradScaler expects a process_group that contains this rank, but rank {rank} is not"):
        ShardedGradScaler(process_group=singles[1 - rank])
    model = small_fsdp(use_orig_params)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    owner = r"a parameter of shape \(4, 4\)" if use_orig_params else r"the flat parameter of Sequential"
    for group in (singles[rank], FakeSingleRankGroup()):
        scaler = ShardedGradScaler(init_scale=2.0, process_group=group)
        one_step(model, optim, scaler, rank)
        grads = [local(p.grad).clone() for p in model.parameters()]
        with pytest.raises(ValueError, match=(
            rf"^ShardedGradScaler expects process_group to contain every rank holding a piece of the optimizer's "
            rf"parameters, but {owner} lives on ranks \[0, 1\] and process_group has ranks \[{rank}\]"
        )):
            scaler.step(optim)
        assert all(torch.equal(local(p.grad), g) for p, g in zip(model.parameters(), grads))  # untouched
    # The default group holds the mesh; plain tensors accept any group, without communication.
    scaler = ShardedGradScaler(init_scale=2.0)
    one_step(model, optim, scaler, rank)
    scaler.step(optim)
    plain = nn.Linear(2, 2)
    plain_optim = torch.optim.SGD(plain.parameters(), lr=0.1)
    scaler = ShardedGradScaler(process_group=singles[rank])
    scaler.scale(plain(torch.ones(1, 2)).sum()).backward()
    with comm.record_comms() as records:
        scaler.step(plain_optim)
    assert records == []
