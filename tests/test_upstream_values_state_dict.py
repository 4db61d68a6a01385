"""Value gaps from tests/UPSTREAM.md's work queue: model and optimizer state dicts (both front ends).

Each is closed against torch's FSDP as the oracle: one body runs with each library
(tests/upstream_oracle.py says how).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from upstream_oracle import (
    MLP,
    Tied,
    WithNamedBuffer,
    api,
    assert_same,
    both,
    full_params,
    full_state,
    rank_batches,
    sgd_train,
    wrap_fsdp1,
)

import fullshard
from fullshard.testing import case, distributed, full_value

# Out of the inner loop: torch's oracle on upstream behaviours whose paths the inner loop's parity tests take.
pytestmark = pytest.mark.slow


# -- test_fsdp_optim_state.py scatter_full_optim_state_dict, shard_full_optim_state_dict at half ------
def trained_wrapper(lib, group=None, tied: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    kwargs = {} if group is None else {"process_group": group}
    model = wrap_fsdp1(
        lib, Tied() if tied else MLP(), classes=() if tied else (nn.Linear,), use_orig_params=False, **kwargs
    )
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optim


@distributed(world_size=2)
def test_full_optim_state_dict_scattered_and_sharded_at_half_the_world_matches_torch():
    """A full optimizer state dict of a trained wrapper: ``scatter_full_optim_state_dict``
    from rank 0 gives each rank exactly its own optimizer state, and
    ``shard_full_optim_state_dict`` into a wrapper on a one-rank group (half the
    world) loads torch's states, which then train on as torch's. Our
    ``scatter_full_optim_state_dict`` into that group loads the same states
    (torch's fails there: it broadcasts from global rank 0, not in the group). An MLP
    and a model with tied weights."""
    halves = [dist.new_group([0]), dist.new_group([1])]
    half = halves[dist.get_rank()]

    def body(lib, load="shard", tied=False):
        model, optim = trained_wrapper(lib, tied=tied)
        sgd_train(model, rank_batches(2, 4, 8), optim=optim)
        full = lib.FSDP.full_optim_state_dict(model, optim, rank0_only=False)
        rank0_full = lib.FSDP.full_optim_state_dict(model, optim)
        torch.manual_seed(1)
        fresh, _ = trained_wrapper(lib, tied=tied)
        scattered = lib.FSDP.scatter_full_optim_state_dict(rank0_full if dist.get_rank() == 0 else None, fresh)
        assert_same(scattered["state"], optim.state_dict()["state"], 0.0, 0.0, "scattered")
        torch.manual_seed(1)
        small, small_optim = trained_wrapper(lib, half, tied)
        if load == "shard":
            sharded = lib.FSDP.shard_full_optim_state_dict(full, small)
        else:
            sharded = lib.FSDP.scatter_full_optim_state_dict(full, small, group=half)
        small_optim.load_state_dict(sharded)
        with lib.FSDP.summon_full_params(model), lib.FSDP.summon_full_params(small, writeback=True):
            with torch.no_grad():
                for param, small_param in zip(model.parameters(), small.parameters()):
                    small_param.copy_(param)
        loaded = small_optim.state_dict()["state"]
        return (
            scattered["state"],
            loaded,
            sgd_train(small, rank_batches(2, 4, 8, seed=5), optim=small_optim),
            full_state(small),
        )

    for tied in (False, True):
        with case(f"tied={tied}"):
            runs = both(functools.partial(body, tied=tied))
            torch.manual_seed(0)
            scattered = body(api("fullshard"), load="scatter", tied=tied)
            assert_same(scattered, runs["torch"], 0.0, 0.0, "scattered at half")


# -- test_fsdp_state_dict.py test_local_state_dict_with_empty_ranks ---------------------------------
def local_shards(value: Any) -> list[torch.Tensor]:
    """A local state dict value's local shards (a ShardedTensor holds none on a rank with only padding)."""
    if hasattr(value, "local_shards"):
        return [shard.tensor.clone() for shard in value.local_shards()]
    return [value.clone()]


class OneElement(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


@distributed(world_size=2)
def test_one_element_parameter_local_state_dict_and_writeback_match_torch():
    """A one-element parameter on 2 ranks (rank 1's shard is padding only): its local
    state dict loads into another wrapper (of other values), and
    ``summon_full_params(writeback=True)`` keeps only the owning rank's write
    (each rank writes its own value); torch's values throughout."""
    from torch.distributed.fsdp import StateDictType as TorchStateDictType

    def body(lib):
        state_dict_type = TorchStateDictType if lib.lib == "torch" else fullshard.StateDictType
        model = lib.FSDP(OneElement(), use_orig_params=False, device_id=torch.device("cpu"))
        other = OneElement()
        with torch.no_grad():
            other.scale.fill_(7.0)
        other = lib.FSDP(other, use_orig_params=False, device_id=torch.device("cpu"))
        results = []
        with lib.FSDP.state_dict_type(model, state_dict_type.LOCAL_STATE_DICT):
            local = model.state_dict()
            saved = {k: local_shards(v) for k, v in local.items()}
            with lib.FSDP.state_dict_type(other, state_dict_type.LOCAL_STATE_DICT):
                other.load_state_dict(local)
        model = other
        results += [saved, full_state(model)]
        with lib.FSDP.summon_full_params(model, writeback=True):
            with torch.no_grad():
                model.scale.fill_(10.0 + dist.get_rank())
        results.append(full_state(model))
        results.append(sgd_train(model, rank_batches(2, 4, 1)))
        results.append(full_state(model))
        return results

    runs = both(body)
    assert runs["fullshard"][1]["scale"].item() == 2.0
    assert runs["fullshard"][2]["scale"].item() == 10.0


# -- 2-D meshes (4 ranks) ----------------------------------------------------------------------------
def tp_mlp(mesh) -> nn.Module:
    """The column-then-row-parallel two-layer MLP of ``mesh["tp"]`` (seeded the same everywhere)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    return parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})


# -- test_fully_shard_state_dict.py test_2d_state_dict_correctness -----------------------------------
@distributed(world_size=4)
def test_2d_state_dict_full_values_match_the_local_model_and_torch():
    """Tensor parallel over "tp", ``fully_shard`` over "dp" of a (2, 2) mesh: every
    state-dict entry's full value is the local model's, before and after 3 Adam
    steps (the local model trained on every dp rank's batch), and equals torch's;
    loading it into a fresh 2-D model gives the same full values."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    ref_optim = torch.optim.Adam(ref.parameters(), lr=1e-2)
    dp_rank = mesh["dp"].get_local_rank()
    batches = [torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(r + 1)) for r in range(2)]
    for step in range(3):
        ref(torch.cat([batches[r][step] for r in range(2)])).sum().mul(0.5).backward()
        ref_optim.step()
        ref_optim.zero_grad()

    def body(lib):
        model = tp_mlp(mesh)
        lib.fully_shard(model[0], mesh=mesh["dp"])
        lib.fully_shard(model, mesh=mesh["dp"])
        initial = {k: full_value(v) for k, v in model.state_dict().items()}
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = sgd_train(model, list(batches[dp_rank]), optim=optim)
        trained = {k: full_value(v) for k, v in model.state_dict().items()}
        fresh = tp_mlp(mesh)
        lib.fully_shard(fresh[0], mesh=mesh["dp"])
        lib.fully_shard(fresh, mesh=mesh["dp"])
        fresh.load_state_dict(model.state_dict())
        loaded = {k: full_value(v) for k, v in fresh.state_dict().items()}
        return initial, losses, trained, loaded

    runs = both(body)
    torch.manual_seed(0)
    local = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).state_dict()
    initial, _, trained, loaded = runs["fullshard"]
    assert_same(initial, dict(local), 0.0, 0.0, "initial")
    assert_same(trained, dict(ref.state_dict()), 1e-6, 1e-5, "trained")  # the local model sums in another order
    assert_same(loaded, trained, 0.0, 0.0, "loaded")


# -- checkpoint/fsdp/test_fsdp_dsd.py: FSDP1, TP and FSDP + TP checkpoints loaded into each other ----
def _two_blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(2)))


def _tensor_parallel(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        f"{block}.{layer}": style()
        for block in range(2)
        for layer, style in ((0, ColwiseParallel), (2, RowwiseParallel))
    }
    return parallelize_module(model, mesh, plan)


@distributed(world_size=4)
def test_wrapper_tp_and_fully_shard_tp_checkpoints_load_into_each_other_as_the_unsharded_model():
    """torch's test_save_with_fsdp1_and_load_with_fsdp2_tp, test_save_with_tp_and_load_with_fsdp2_tp
    and test_save_with_fsdp2_tp_and_load_with_tp: after one AdamW step on the same batch, the
    sharded dicts (torch's state-dict API) of the wrapper on 4 ranks, of tensor parallelism on 4
    ranks and of ``fully_shard`` over tensor parallelism on a (2, 2) mesh, and the full dicts of
    the unsharded model and of ``fully_shard`` + TP, saved in one DCP checkpoint, load into
    ``fully_shard`` + TP (the first three) or into TP alone (the last two), whose full model and
    optimizer dicts are then the unsharded model's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from fullshard.wrap import ModuleWrapPolicy

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    world = init_device_mesh("cpu", (4,))
    full = StateDictOptions(full_state_dict=True)
    batch = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))  # every rank's

    def trained(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        optim = torch.optim.AdamW(model.parameters(), lr=0.1)
        _sharded_step(model, optim, batch)
        return model, optim

    def fully_shard_tp() -> nn.Module:
        model = _tensor_parallel(_two_blocks(), mesh["tp"])
        for block in model:
            fullshard.fully_shard(block, mesh=mesh["dp"])
        return fullshard.fully_shard(model, mesh=mesh["dp"])

    def tp_only() -> nn.Module:
        return _tensor_parallel(_two_blocks(), world)

    def wrapper() -> nn.Module:
        policy = ModuleWrapPolicy({nn.Linear})
        return fullshard.FSDP(_two_blocks(), device_mesh=world, use_orig_params=True, auto_wrap_policy=policy)

    expected = get_state_dict(*trained(_two_blocks()))
    path = _shared_tmpdir()
    with fullshard.use_in_place_of_torch():
        fsdp_tp = trained(fully_shard_tp())
        sources = {
            "unsharded": expected,
            "wrapper": get_state_dict(*trained(wrapper())),
            "tp": get_state_dict(*trained(tp_only())),
            "fully_shard + tp": get_state_dict(*fsdp_tp),
            "fully_shard + tp, full": get_state_dict(*fsdp_tp, options=full),
        }
        dcp.save({name: {"model": msd, "optim": osd} for name, (msd, osd) in sources.items()}, checkpoint_id=path)
        for target, build, names in (
            ("fully_shard + tp", fully_shard_tp, ("unsharded", "wrapper", "tp")),
            ("tp", tp_only, ("fully_shard + tp", "fully_shard + tp, full")),
        ):
            for name in names:
                with case(f"{name} into {target}"):
                    model = build()
                    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
                    msd, osd = get_state_dict(model, optim)
                    state = {name: {"model": msd, "optim": osd}}
                    dcp.load(state, checkpoint_id=path)
                    set_state_dict(
                        model, optim, model_state_dict=state[name]["model"], optim_state_dict=state[name]["optim"]
                    )
                    loaded = get_state_dict(model, optim, options=full)
                    _assert_full_dicts_equal(loaded[0], expected[0], "model")
                    _assert_full_dicts_equal(loaded[1], expected[1], "optim")


# -- test_fsdp_tp_checkpoint_conversion.py test_fsdp_to_tp -------------------------------------------
@distributed(world_size=2)
def test_wrapper_sharded_checkpoint_loads_into_a_tensor_parallel_model_like_torch():
    """A wrapper's ``SHARDED_STATE_DICT`` (after a training step) saved with DCP and
    loaded into a tensor-parallel model of the same architecture: the TP model's
    full values are the wrapper's full parameters, and equal torch's; the TP
    model then computes the wrapper's outputs."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import StateDictType as TorchStateDictType

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    paths = [tempfile.mkdtemp(prefix="fullshard-fsdp-to-tp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(paths)

    def body(lib):
        state_dict_type = TorchStateDictType if lib.lib == "torch" else fullshard.StateDictType
        torch.manual_seed(0)
        model = wrap_fsdp1(lib, nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), use_orig_params=True)
        sgd_train(model, rank_batches(1, 4, 8))
        full = full_state(model)
        path = f"{paths[0]}/{lib.lib}"
        with lib.FSDP.state_dict_type(model, state_dict_type.SHARDED_STATE_DICT):
            dcp.save(model.state_dict(), checkpoint_id=path)
        tp = tp_mlp(mesh)
        state = tp.state_dict()
        dcp.load(state, checkpoint_id=path)
        tp.load_state_dict(state)
        loaded = {k: full_value(v) for k, v in tp.state_dict().items()}
        assert_same(loaded, full, 0.0, 0.0, "loaded into TP")
        probe = torch.ones(2, 8)
        with torch.no_grad():
            torch.testing.assert_close(tp(probe), model(probe), atol=1e-6, rtol=1e-5)
        return loaded

    try:
        both(body)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            import shutil

            shutil.rmtree(paths[0], ignore_errors=True)


# -- test_fsdp_state_dict.py test_state_dict_type, test_state_dict_with_ignored_modules --------------
@distributed(world_size=2)
def test_state_dict_type_context_and_ignored_modules_match_torch():
    """The wrapper against torch's: ``state_dict_type`` sets the type inside the
    block and restores FULL_STATE_DICT on exit; a full state dict with an
    ignored module (``prefix=`` given) holds the ignored parameters uncloned (the
    same storage as the module's) and the buffers in their original dtype under
    buffer mixed precision (the same dtypes and values as torch's), and loads
    into a plain model."""
    from torch.distributed.fsdp import StateDictType as TorchStateDictType

    def body(lib):
        types_ = TorchStateDictType if lib.lib == "torch" else fullshard.StateDictType
        plain = WithNamedBuffer()
        ignored = plain.layers[1]
        mp = lib.MixedPrecision(buffer_dtype=torch.float16)
        model = lib.FSDP(plain, ignored_modules=[ignored], mixed_precision=mp, device_id=torch.device("cpu"))
        names = [lib.FSDP.get_state_dict_type(model).state_dict_type.name]
        with lib.FSDP.state_dict_type(model, types_.SHARDED_STATE_DICT):
            names.append(lib.FSDP.get_state_dict_type(model).state_dict_type.name)
        names.append(lib.FSDP.get_state_dict_type(model).state_dict_type.name)
        state = model.state_dict(prefix="top.")
        same_storage = [
            state["top.layers.1.weight"].data_ptr() == ignored.weight.data_ptr(),
            state["top.layers.1.bias"].data_ptr() == ignored.bias.data_ptr(),
        ]
        fresh = WithNamedBuffer()
        fresh.load_state_dict({k[len("top.") :]: v for k, v in state.items()})
        return names, same_storage, {k: (str(v.dtype), v.clone()) for k, v in state.items()}, full_params(fresh)

    runs = both(body)
    assert runs["fullshard"][0] == ["FULL_STATE_DICT", "SHARDED_STATE_DICT", "FULL_STATE_DICT"]
    assert runs["fullshard"][1] == [True, True]


# -- checkpoint/test_state_dict.py, e2e/test_fsdp.py: torch's state-dict API over our modules --------
def _shared_tmpdir() -> str:
    """One fresh directory, made on rank 0, known to every rank."""
    import tempfile

    name = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return name[0]


def _local_step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> None:
    """One step of an unsharded model on this rank's batch with gradients averaged over the
    ranks: what data-parallel training computes."""
    model(x).sum().backward()
    for param in model.parameters():
        dist.all_reduce(param.grad)
        param.grad.div_(dist.get_world_size())
    optim.step()
    optim.zero_grad()


def _sharded_step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).sum().backward()
    optim.step()
    optim.zero_grad()


def _assert_full_dicts_equal(ours: dict, theirs: dict, where: str) -> None:
    assert list(ours) == list(theirs), f"{where}: {list(ours)} vs {list(theirs)}"
    for key, value in theirs.items():
        if isinstance(value, dict):
            _assert_full_dicts_equal(ours[key], value, f"{where}.{key}")
        elif isinstance(value, torch.Tensor):
            torch.testing.assert_close(full_value(ours[key]), full_value(value), msg=lambda m: f"{where}.{key}: {m}")
        else:
            assert ours[key] == value, f"{where}.{key}"


def _layered() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Sequential(nn.Linear(6, 6), nn.ReLU()), nn.Linear(6, 3))


def _state_dict_api_round_trip(
    label: str,
    shard: Callable[[nn.Module], nn.Module],
    build: Callable[[], nn.Module] = _layered,
    missing_key_raises: bool = True,
) -> None:
    """torch's TestStateDict.test_fsdp / e2e test_fsdp with ``shard`` as the wrapper: ``get_state_dict``
    before the first forward; after two steps its full dicts equal an unsharded model's (same keys,
    the optimizer's included), its sharded ones are saved with DCP and loaded with ``set_state_dict``
    into a new model, which then steps as the unsharded one; a full dict held by rank 0 alone loads
    with ``broadcast_from_rank0``, and ``strict`` reports a missing key."""
    import copy

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    torch.manual_seed(0)
    local = build()
    fresh = shard(copy.deepcopy(local))  # before lazy init (torch's test_fsdp_root_not_initialized)
    get_model_state_dict(fresh)
    get_optimizer_state_dict(fresh, torch.optim.Adam(fresh.parameters(), lr=0.1))  # steps it with zero grads
    model = shard(copy.deepcopy(local))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    local_optim = torch.optim.Adam(local.parameters(), lr=0.1)
    batches = rank_batches(4, 2, 4)
    for x in batches[:2]:
        _local_step(local, local_optim, x)
        _sharded_step(model, optim, x)
    local_msd, local_osd = get_state_dict(local, local_optim)
    msd, osd = get_state_dict(model, optim, options=full)
    _assert_full_dicts_equal(msd, local_msd, f"{label} model")
    _assert_full_dicts_equal(osd, local_osd, f"{label} optim")
    offloaded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in offloaded.values()), label
        _assert_full_dicts_equal(offloaded, local_msd, f"{label} cpu_offload")
    else:
        assert offloaded == {}, label
    msd, osd = get_state_dict(model, optim)  # sharded
    assert set(osd["state"]) == {name for name, _ in local.named_parameters()}, f"{label}: {list(osd['state'])}"
    path = _shared_tmpdir()
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    torch.manual_seed(1)
    other = shard(build())
    other_optim = torch.optim.Adam(other.parameters(), lr=0.1)
    target_msd, target_osd = get_state_dict(other, other_optim)
    loaded = {"model": target_msd, "optim": target_osd}
    dcp.load(loaded, checkpoint_id=path)
    set_state_dict(other, other_optim, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    _sharded_step(other, other_optim, batches[2])
    _local_step(local, local_optim, batches[2])
    local_msd, local_osd = get_state_dict(local, local_optim)
    msd, osd = get_state_dict(other, other_optim, options=full)
    _assert_full_dicts_equal(msd, local_msd, f"{label} loaded model")
    _assert_full_dicts_equal(osd, local_osd, f"{label} loaded optim")
    zeros = {k: torch.zeros_like(v) for k, v in local_msd.items()}
    rank0_only = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(other, dict(zeros) if dist.get_rank() == 0 else {}, options=rank0_only)  # it rewrites the dict
    assert all(not full_value(v).any() for v in get_model_state_dict(other, options=full).values()), label
    if missing_key_raises:  # torch's API raises it on rank 0 alone for a compiled model: the others hang
        missing = dict(list(zeros.items())[1:])
        with pytest.raises(RuntimeError, match="Missing key"):
            set_model_state_dict(other, missing if dist.get_rank() == 0 else {}, options=rank0_only)


def _patched_methods_round_trip(label: str, shard: Callable[[nn.Module], nn.Module]) -> None:
    """torch's TestE2ESaveAndLoad.test_e2e: the model's and optimizer's ``state_dict`` methods patched
    to torch's API, the objects themselves handed to DCP (with a stateful entry of the user's):
    a new model loads them and steps on as an unsharded model does."""
    import copy

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        _patch_model_state_dict,
        _patch_optimizer_state_dict,
        get_state_dict,
    )

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = shard(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Sequential(nn.Linear(6, 6)), nn.Linear(6, 3)))
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        _patch_model_state_dict(model)
        _patch_optimizer_state_dict(model, optimizers=optim)
        return model, optim

    torch.manual_seed(0)
    local = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Sequential(nn.Linear(6, 6)), nn.Linear(6, 3))
    local_optim = torch.optim.Adam(local.parameters(), lr=0.1)
    model, optim = build(0)
    batches = rank_batches(3, 2, 4, seed=7)
    for x in batches[:2]:
        _local_step(local, local_optim, x)
        _sharded_step(model, optim, x)
    path = _shared_tmpdir()
    dcp.save({"model": model, "optimizer": optim, "step": torch.tensor(2)}, checkpoint_id=path)
    other, other_optim = build(1)
    loaded = {"model": other, "optimizer": other_optim, "step": torch.tensor(0)}
    dcp.load(loaded, checkpoint_id=path)
    assert loaded["step"].item() == 2, label
    _sharded_step(other, other_optim, batches[2])
    _local_step(local, local_optim, batches[2])
    local_msd, local_osd = get_state_dict(local, local_optim)
    msd, osd = get_state_dict(other, other_optim, options=StateDictOptions(full_state_dict=True))
    _assert_full_dicts_equal(msd, local_msd, f"{label} patched model")
    _assert_full_dicts_equal(osd, local_osd, f"{label} patched optim")


@distributed(world_size=2)
def test_torch_state_dict_api_on_the_wrapper_and_fully_shard_matches_an_unsharded_model():
    """The FSDP1 wrapper (flat and original parameters, auto-wrapped, on a device mesh or not)
    once ``fullshard.use_in_place_of_torch()`` points torch's state-dict API at it, and
    ``fully_shard`` (which needs no rebinding: its parameters are DTensors)."""
    from torch.distributed.device_mesh import init_device_mesh

    from fullshard.wrap import ModuleWrapPolicy

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = ModuleWrapPolicy({nn.Linear})
    wrappers = {
        "flat, auto-wrapped": lambda m: fullshard.FSDP(m, auto_wrap_policy=policy),
        "orig params on a mesh": lambda m: fullshard.FSDP(
            m, auto_wrap_policy=policy, device_mesh=mesh, use_orig_params=True
        ),
        "flat on a mesh, one unit": lambda m: fullshard.FSDP(m, device_mesh=mesh),
    }
    with fullshard.use_in_place_of_torch():
        for label, shard in wrappers.items():
            with case(label):
                _state_dict_api_round_trip(label, shard)
        with case("patched methods"):
            _patched_methods_round_trip("patched methods", wrappers["orig params on a mesh"])

    def fully_shard_all(model: nn.Module) -> nn.Module:
        for layer in (model[0], model[2], model[3]):
            fullshard.fully_shard(layer)
        return fullshard.fully_shard(model)

    with case("fully_shard"):
        _state_dict_api_round_trip("fully_shard", fully_shard_all)


@distributed(world_size=2)
def test_torch_state_dict_api_refuses_the_wrapper_it_does_not_know():
    """Without the rebinding torch's API would key the wrapper's optimizer states by internal names
    and save its shards as replicated tensors: it raises naming the fix instead."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = fullshard.FSDP(nn.Sequential(nn.Linear(4, 4)))
    optim = torch.optim.Adam(model.parameters())
    with pytest.raises(RuntimeError, match=r"finds FSDP1 wrappers by torch's class .*use_in_place_of_torch\(\)"):
        get_state_dict(model, optim)


@distributed(world_size=4)
def test_torch_state_dict_api_on_a_hybrid_wrapper_matches_an_unsharded_model():
    """The same on a (replicate, shard) mesh with HYBRID_SHARD (torch's test_e2e's HSDP model,
    test_broadcast_from_rank0_hsdp), through torch's API and the patched methods."""
    from torch.distributed.device_mesh import init_device_mesh

    from fullshard.wrap import ModuleWrapPolicy

    mesh = init_device_mesh("cpu", (2, 2))

    def hybrid(model: nn.Module) -> nn.Module:
        return fullshard.FSDP(
            model,
            device_mesh=mesh,
            sharding_strategy=fullshard.ShardingStrategy.HYBRID_SHARD,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        )

    with fullshard.use_in_place_of_torch():
        with case("get/set"):
            _state_dict_api_round_trip("hybrid", hybrid)
        with case("patched methods"):
            _patched_methods_round_trip("hybrid patched", hybrid)


class TiedEmbedding(nn.Module):
    """An embedding whose weight the decoder shares (torch's test_shared_weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(16, 8)
        self.decoder = nn.Linear(8, 16)
        self.decoder.weight = self.embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.embedding((x.abs() * 10).long() % 16))


@distributed(world_size=2)
def test_torch_state_dict_api_options_on_our_modules_like_torch():
    """More of torch's test_state_dict.py over our modules, through torch's API: keys without the
    checkpoint wrapper's prefix (test_activation_ckpt_fqns_fsdp1), frozen parameters left out with
    ignore_frozen_params (test_frozen_parameters), a tied weight round-tripping under the wrapper
    (test_shared_weight, flattened optimizer dict too), initial_lr restored from rank 0
    (test_optim_state_dict_param_matching), flattened and nested optimizer dicts loading alike
    (test_flattened_osd), and get_model_state_dict equal to state_dict() for fully_shard, also after
    a forward that keeps parameters unsharded (test_fsdp_dsd's test_1d_fsdp_get_model_state_dict)."""
    import copy
    from itertools import product

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_optimizer_state_dict,
        set_state_dict,
    )

    def layered() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Sequential(nn.Linear(6, 6)), nn.Linear(6, 3))

    with fullshard.use_in_place_of_torch():
        with case("checkpoint prefixes"):
            expected = list(get_model_state_dict(layered()))
            for use_orig_params in (False, True):
                model = layered()
                apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.Linear))
                model = fullshard.FSDP(model, use_orig_params=use_orig_params)
                assert list(get_model_state_dict(model)) == expected, use_orig_params
                assert list(get_optimizer_state_dict(model, torch.optim.Adam(model.parameters()))["state"]) == expected
        with case("frozen parameters"):
            for shard in (
                lambda m: fullshard.FSDP(m, use_orig_params=True),
                lambda m: fullshard.fully_shard(m),
            ):
                model = layered()
                model[0].requires_grad_(False)
                model = shard(model)
                optim = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
                _sharded_step(model, optim, torch.randn(2, 4))
                msd, osd = get_state_dict(model, optim, options=StateDictOptions(ignore_frozen_params=True))
                assert list(msd) == ["2.0.weight", "2.0.bias", "3.weight", "3.bias"], list(msd)
                assert list(osd["state"]) == list(msd)
        with case("tied weight"):
            torch.manual_seed(0)
            local = TiedEmbedding()
            for flatten in (False, True):
                options = StateDictOptions(flatten_optimizer_state_dict=flatten)
                model = fullshard.FSDP(copy.deepcopy(local))
                optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
                local_model = copy.deepcopy(local)
                local_optim = torch.optim.AdamW(local_model.parameters(), lr=1e-2)
                for x in rank_batches(2, 3, 4):
                    _local_step(local_model, local_optim, x)
                    _sharded_step(model, optim, x)
                msd, osd = get_state_dict(model, optim, options=options)
                other = fullshard.FSDP(TiedEmbedding())
                other_optim = torch.optim.AdamW(other.parameters(), lr=1e-2)
                set_state_dict(other, other_optim, model_state_dict=msd, optim_state_dict=osd, options=options)
                full = StateDictOptions(full_state_dict=True)
                ours = get_state_dict(other, other_optim, options=full)
                theirs = get_state_dict(local_model, local_optim)
                _assert_full_dicts_equal(ours[0], theirs[0], f"tied flatten={flatten} model")
                _assert_full_dicts_equal(ours[1], theirs[1], f"tied flatten={flatten} optim")
    with case("initial_lr from rank 0"):
        model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
        for layer in model:
            fullshard.fully_shard(layer)
        fullshard.fully_shard(model)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda=[lambda epoch: 0.95**epoch])
        saved = get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        assert "initial_lr" in saved["param_groups"][0] if dist.get_rank() == 0 else saved == {}
        fresh = torch.optim.Adam(model.parameters(), lr=1e-2)
        set_optimizer_state_dict(
            model, fresh, saved, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        )
        assert "initial_lr" in fresh.param_groups[0] or dist.get_rank() != 0  # torch's API gives rank 0 the groups
    with case("flattened optimizer dicts"):
        for flatten_to_save, flatten_to_load in product([True, False], repeat=2):
            model = fullshard.fully_shard(layered())
            optim = torch.optim.AdamW(model.parameters())
            _sharded_step(model, optim, torch.randn(2, 4))
            osd = get_optimizer_state_dict(
                model, optim, options=StateDictOptions(flatten_optimizer_state_dict=flatten_to_save)
            )
            other = torch.optim.AdamW(model.parameters())
            set_optimizer_state_dict(
                model, other, osd, options=StateDictOptions(flatten_optimizer_state_dict=flatten_to_load)
            )
            _assert_full_dicts_equal(other.state_dict()["state"], optim.state_dict()["state"], "flattened")
            assert other.state_dict()["param_groups"] == optim.state_dict()["param_groups"]
    with case("get_model_state_dict is state_dict()"):
        for reshard_after_forward, dims in product((True, False), ((4, 6, 3), (5, 7, 3))):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(dims[0], dims[1]), nn.ReLU(), nn.Linear(dims[1], dims[2]))
            for layer in (model[0], model[2]):
                fullshard.fully_shard(layer, reshard_after_forward=reshard_after_forward)
            fullshard.fully_shard(model, reshard_after_forward=reshard_after_forward)
            for _ in range(2):  # before any forward, then after one
                ours, plain = get_model_state_dict(model), model.state_dict()
                assert list(ours) == list(plain)
                for key, value in plain.items():
                    assert type(ours[key]) is type(value), key
                    torch.testing.assert_close(full_value(ours[key]), full_value(value), rtol=0, atol=0)
                model(torch.randn(2, dims[0]))


# -- checkpoint/test_state_dict.py test_compiled_fsdp, test_fsdp_ddp ---------------------------------
def _named_layers() -> nn.Module:
    """``_layered`` with names no other parameter's FQN ends in (see the compiled case below)."""
    from collections import OrderedDict

    hidden = nn.Sequential(OrderedDict(hidden=nn.Linear(6, 6), act=nn.ReLU()))
    return nn.Sequential(OrderedDict(inp=nn.Linear(4, 6), act=nn.ReLU(), mid=hidden, out=nn.Linear(6, 3)))


@distributed(world_size=2)
def test_torch_state_dict_api_on_a_compiled_wrapper_and_beside_data_parallel_submodules_matches_an_unsharded_model():
    """The round trip above for a compiled wrapper (torch's API drops the compiled module's
    ``_orig_mod.`` prefix), for a wrapper that ignores a DDP submodule, and for ``fully_shard``
    beside a submodule that ``replicate`` (torch's or ours) manages: the keys are the unsharded
    model's, and the values too, before and after a DCP round trip. For a compiled model
    torch's API renames optimizer keys by substring (``2.0.weight`` becomes
    ``2._orig_mod.0.weight`` beside ``0.weight``): loading then raises ``KeyError``, as with
    torch's FSDP, instead of dropping those states. (A full dict missing a key, broadcast from
    rank 0, is not tried on the compiled model: torch's API raises on rank 0 alone there.)"""
    from torch.distributed._composable import replicate as torch_replicate
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )
    from torch.nn.parallel import DistributedDataParallel

    def compiled(model: nn.Module) -> nn.Module:
        return torch.compile(fullshard.FSDP(model, use_orig_params=True), backend="eager")

    def ignoring_a_ddp_submodule(lib) -> list[Any]:
        """Torch's API keys this wrapper's optimizer states by DDP's names (``2.module.0.weight``)
        and its model dict without them, for torch's FSDP as for ours: loading the optimizer dict
        back then raises in torch's API for both; the model dict loads."""

        def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
            torch.manual_seed(seed)
            model = _layered()
            model[2] = DistributedDataParallel(model[2])
            policy = lib.ModuleWrapPolicy({nn.Linear})
            model = lib.FSDP(model, ignored_modules=[model[2]], auto_wrap_policy=policy, device_id=torch.device("cpu"))
            return model, torch.optim.Adam(model.parameters(), lr=0.1)

        model, optim = build(0)
        for x in rank_batches(2, 2, 4):
            _sharded_step(model, optim, x)
        saved = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
        other, other_optim = build(1)
        msd, osd = get_state_dict(model, optim)
        with pytest.raises(RuntimeError, match="Missing optimizer state for parameter '2.0.weight'"):
            set_state_dict(other, other_optim, model_state_dict=msd, optim_state_dict=osd)
        set_model_state_dict(other, msd)
        _assert_full_dicts_equal(
            get_model_state_dict(other, options=StateDictOptions(full_state_dict=True)), saved[0], "loaded"
        )
        return [
            list(saved[0]),
            list(saved[1]["state"]),
            {k: full_value(v) for k, v in saved[0].items()},
            saved[1]["state"],
        ]

    def beside(replicate: Callable[[nn.Module], Any]) -> Callable[[nn.Module], nn.Module]:
        def shard(model: nn.Module) -> nn.Module:
            replicate(model[2])
            for layer in (model[0], model[3]):
                fullshard.fully_shard(layer)
            return fullshard.fully_shard(model, ignored_modules=[model[2]])

        return shard

    with case("torch's wrapper ignoring a DDP submodule"):
        theirs = ignoring_a_ddp_submodule(api("torch"))
    with fullshard.use_in_place_of_torch():
        with case("compiled wrapper"):
            _state_dict_api_round_trip("compiled wrapper", compiled, _named_layers, missing_key_raises=False)
            with pytest.raises(KeyError, match=r"param_groups name \['2._orig_mod.0.weight'"):
                _state_dict_api_round_trip("compiled wrapper, renamed keys", compiled)
        with case("wrapper ignoring a DDP submodule"):
            assert_same(ignoring_a_ddp_submodule(api("fullshard")), theirs, 1e-6, 1e-5, "ignoring a DDP submodule")
    for label, replicate in {
        "torch's replicate": torch_replicate,
        "fullshard's replicate": fullshard.replicate,
    }.items():
        with case(f"fully_shard beside {label}"):
            _state_dict_api_round_trip(label, beside(replicate))


# -- checkpoint/e2e/test_fine_tuning.py test_fine_tuning ---------------------------------------------
class Pretrained(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 6)
        self.second = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.second(torch.relu(self.first(x))))


class FineTuned(nn.Module):
    """A frozen pretrained trunk under a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.pretrain = Pretrained().requires_grad_(False)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pretrain(x))


@distributed(world_size=2)
def test_fine_tuning_loads_a_pretrained_checkpoint_into_a_frozen_submodule_and_resumes_its_trainable_part():
    """torch's test_fine_tuning with the wrapper: a pretrained wrapper's dicts saved with DCP load
    into the frozen submodule of a fine-tuning wrapper (``submodules=``, ``strict=False``), whose
    trainable part alone is saved (``ignore_frozen_params``) and, after a restart, loaded back:
    the restarted run ends where an uninterrupted one does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    trainable_only = StateDictOptions(ignore_frozen_params=True)
    pretrain_dir, finetune_dir = _shared_tmpdir(), _shared_tmpdir()
    batches = rank_batches(4, 2, 4)
    with fullshard.use_in_place_of_torch():
        torch.manual_seed(0)
        pretrained = fullshard.FSDP(Pretrained())
        pretrained_optim = torch.optim.Adam(pretrained.parameters(), lr=1e-2)
        for x in batches[:2]:
            _sharded_step(pretrained, pretrained_optim, x)
        msd, osd = get_state_dict(pretrained, pretrained_optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=pretrain_dir)
        pretrained_full = get_model_state_dict(pretrained, options=full)

        def fine_tuning_wrapper() -> tuple[nn.Module, torch.optim.Optimizer]:
            torch.manual_seed(1)
            model = fullshard.FSDP(FineTuned(), use_orig_params=True)
            optim = torch.optim.Adam(model.parameters(), lr=1e-2)
            trunk = get_model_state_dict(
                model, submodules={model.pretrain}, options=StateDictOptions(keep_submodule_prefixes=False)
            )
            dcp.load({"model": trunk}, checkpoint_id=pretrain_dir)
            set_model_state_dict(model, {model.pretrain: trunk}, options=StateDictOptions(strict=False))
            loaded = get_model_state_dict(model, options=full)
            _assert_full_dicts_equal(
                {k[len("pretrain.") :]: v for k, v in loaded.items() if k.startswith("pretrain.")},
                pretrained_full,
                "pretrained trunk",
            )
            return model, optim

        model, optim = fine_tuning_wrapper()
        for x in batches[:2]:
            _sharded_step(model, optim, x)
        msd, osd = get_state_dict(model, optim, options=trainable_only)
        assert list(msd) == ["head.weight", "head.bias"] and list(osd["state"]) == list(msd), list(msd)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=finetune_dir)
        for x in batches[2:]:
            _sharded_step(model, optim, x)
        uninterrupted = get_state_dict(model, optim, options=full)

        restarted, restarted_optim = fine_tuning_wrapper()
        msd, osd = get_state_dict(restarted, restarted_optim, options=trainable_only)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=finetune_dir)
        set_state_dict(
            restarted,
            restarted_optim,
            model_state_dict=msd,
            optim_state_dict=osd,
            options=StateDictOptions(strict=False),
        )
        for x in batches[2:]:
            _sharded_step(restarted, restarted_optim, x)
        resumed = get_state_dict(restarted, restarted_optim, options=full)
        _assert_full_dicts_equal(resumed[0], uninterrupted[0], "resumed model")
        _assert_full_dicts_equal(resumed[1], uninterrupted[1], "resumed optim")


# -- checkpoint/e2e/test_fsdp_ep.py test_e2e ---------------------------------------------------------
class ExpertTier(nn.Module):
    """Two expert slots of which this rank holds one (an ``nn.Identity`` in the other), and a
    shared layer; each expert is seeded on its own, so every rank holding it holds its values."""

    def __init__(self, own: int) -> None:
        super().__init__()
        self.own = own
        self.shared = nn.Linear(4, 4)
        experts: list[nn.Module] = []
        for index in range(2):
            torch.manual_seed(100 + index)
            experts.append(nn.Sequential(nn.Linear(4, 4), nn.ReLU()) if index == own else nn.Identity())
        self.experts = nn.ModuleList(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(self.experts[self.own](x))


class WithExperts(nn.Module):
    def __init__(self, own: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(4, 4)
        self.tier = ExpertTier(own)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tier(torch.relu(self.shared(x)))


@distributed(world_size=4)
def test_experts_on_a_mesh_of_their_own_give_state_dicts_on_each_units_mesh_like_torch():
    """torch's TestFSDPWithEP.test_e2e: each expert a wrapper unit on a 2-rank mesh (ranks r and
    r + 2 hold expert r % 2), the rest wrapper units on all 4 ranks; after an Adam step torch's
    ``get_state_dict`` gives each value as a DTensor on its own unit's mesh, only this rank's
    expert, optimizer keys equal to the model's, and the same local values as torch's FSDP."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    expert_mesh = DeviceMesh.from_group(pairs[rank % 2], "cpu")
    world = init_device_mesh("cpu", (4,))

    def body(lib) -> list[Any]:
        model = WithExperts(rank % 2)
        for index, expert in enumerate(model.tier.experts):
            model.tier.experts[index] = lib.FSDP(
                expert, use_orig_params=True, device_mesh=expert_mesh, device_id=torch.device("cpu")
            )
        model.tier = lib.FSDP(model.tier, use_orig_params=True, device_mesh=world, device_id=torch.device("cpu"))
        model = lib.FSDP(model, use_orig_params=True, device_mesh=world, device_id=torch.device("cpu"))
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        _sharded_step(model, optim, rank_batches(1, 2, 4)[0])
        msd, osd = get_state_dict(model, optim)
        assert set(osd["state"]) == set(msd), (list(osd["state"]), list(msd))
        layout = {}
        for key, value in msd.items():
            for entry, tensor in (("value", value), ("exp_avg", osd["state"][key]["exp_avg"])):
                assert isinstance(tensor, DTensor), f"{key} {entry}: {type(tensor).__name__}"
                layout[f"{key} {entry}"] = [tensor.device_mesh.mesh.tolist(), str(tensor.placements), tensor.to_local()]
                assert_same(tensor.full_tensor(), expected[f"{key} {entry}"], 1e-6, 1e-5, f"{key} {entry}")
        return layout

    # the reference: experts' gradients averaged over their pair of ranks, the rest's over all 4
    model = WithExperts(rank % 2)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(rank_batches(1, 2, 4)[0]).sum().backward()
    for name, param in model.named_parameters():
        group = pairs[rank % 2] if ".experts." in name else None
        dist.all_reduce(param.grad.div_(dist.get_world_size(group)), group=group)
    optim.step()
    expected = {}
    for name, param in model.named_parameters():
        expected[f"{name} value"], expected[f"{name} exp_avg"] = param.detach(), optim.state[param]["exp_avg"]
    with case("torch"):
        theirs = body(api("torch"))
    with fullshard.use_in_place_of_torch(), case("fullshard"):
        ours = body(api("fullshard"))
    assert_same(ours, theirs, 1e-6, 1e-5, "state dicts")  # gradients summed in another order
    own = rank % 2
    assert {key.split(" ")[0] for key in ours} == {
        "shared.weight",
        "shared.bias",
        "tier.shared.weight",
        "tier.shared.bias",
        f"tier.experts.{own}.0.weight",
        f"tier.experts.{own}.0.bias",
    }
    assert ours[f"tier.experts.{own}.0.weight value"][0] == [own, own + 2]  # the pair holding it
    assert ours["shared.weight value"][0] == [0, 1, 2, 3]
