"""Construction as torch's FSDP does it: the same body runs against torch 2.13's
``fully_shard`` (FSDP2) / ``FullyShardedDataParallel`` (FSDP1) on gloo and against
fullshard, and must give the same result (issue 13)."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import fullshard
from fullshard.testing import distributed, full_value

CPU = torch.device("cpu")


def api(lib: str) -> types.SimpleNamespace:
    """The names a user imports, from torch or from fullshard."""
    if lib == "torch":
        from torch.distributed import fsdp

        return types.SimpleNamespace(
            fully_shard=fsdp.fully_shard, FSDP=fsdp.FullyShardedDataParallel, ShardingStrategy=fsdp.ShardingStrategy,
            CPUOffloadPolicy=fsdp.CPUOffloadPolicy,
        )
    return types.SimpleNamespace(
        fully_shard=fullshard.fully_shard, FSDP=fullshard.FullyShardedDataParallel,
        ShardingStrategy=fullshard.ShardingStrategy, CPUOffloadPolicy=fullshard.CPUOffloadPolicy,
    )


def three_stage_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), nn.Linear(8, 4))


def train(model: nn.Module, steps: int = 3, dim: int = 4) -> list[float]:
    """SGD steps on rank-dependent data; the losses."""
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(3, dim)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every entry of the state dict as a full tensor, names without wrapper prefixes."""
    return {k.replace("_fsdp_wrapped_module.", ""): full_value(v) for k, v in model.state_dict().items()}


def assert_same_training(runs: dict[str, tuple[list[float], dict[str, torch.Tensor]]]) -> None:
    (losses, state), (other_losses, other_state) = runs["torch"], runs["fullshard"]
    assert losses == pytest.approx(other_losses, rel=1e-6)
    assert state.keys() == other_state.keys()
    for name in state:
        torch.testing.assert_close(other_state[name], state[name], msg=lambda m: f"{name}: {m}")


# -- item 14: one ignore list for several units --------------------------------------------------------
@distributed(world_size=2)
def test_one_ignored_params_list_for_several_units():
    """torch's docs pass one set to every fully_shard call; each unit takes what lies below it."""
    runs = {}
    for lib in ("torch", "fullshard"):
        model = three_stage_model()
        ignored = {model[0].weight, model[1][1].weight}
        api(lib).fully_shard(model[1], ignored_params=ignored)
        api(lib).fully_shard(model, ignored_params=ignored)
        assert not isinstance(model[0].weight, torch.distributed.tensor.DTensor)
        runs[lib] = (train(model), full_state(model))
    assert_same_training(runs)


@distributed(world_size=2)
def test_one_ignored_modules_list_for_several_wrappers():
    runs = {}
    for lib in ("torch", "fullshard"):
        model = three_stage_model()
        ignored = [model[0], model[1][1]]
        model[1] = api(lib).FSDP(model[1], ignored_modules=ignored, device_id=CPU)
        model = api(lib).FSDP(model, ignored_modules=ignored, device_id=CPU)
        runs[lib] = (train(model), full_state(model))
    assert_same_training(runs)


# -- misuse torch rejects: one behaviour per case --------------------------------------------------------
def _fsdp_inside_ignored(ns: types.SimpleNamespace) -> None:
    model = three_stage_model()
    model[1] = ns.FSDP(model[1], device_id=CPU)
    ns.FSDP(model, ignored_modules=[model[1]], device_id=CPU)


def _mixed_ignored_states(ns: types.SimpleNamespace) -> None:
    model = three_stage_model()
    ns.FSDP(model, ignored_states=[model[0], model[2].weight], device_id=CPU)


def _ignored_modules_and_states(ns: types.SimpleNamespace) -> None:
    model = three_stage_model()
    ns.FSDP(model, ignored_modules=[model[0]], ignored_states=[model[2].weight], device_id=CPU)


def _mixed_use_orig_params(ns: types.SimpleNamespace) -> None:
    """torch raises at the first forward, fullshard when the outer wrapper is built."""
    model = three_stage_model()
    model[1] = ns.FSDP(model[1], device_id=CPU, use_orig_params=True)
    ns.FSDP(model, device_id=CPU, use_orig_params=False)(torch.ones(2, 4))


MISUSE = {
    "container_without_forward_list": lambda ns: ns.fully_shard(nn.ModuleList([nn.Linear(4, 4)])),
    "container_without_forward_dict": lambda ns: ns.fully_shard(nn.ModuleDict({"a": nn.Linear(4, 4)})),
    "reshard_after_forward_not_a_divisor": lambda ns: ns.fully_shard(three_stage_model(), reshard_after_forward=3),
    "reshard_after_forward_zero": lambda ns: ns.fully_shard(three_stage_model(), reshard_after_forward=0),
    "reshard_after_forward_str": lambda ns: ns.fully_shard(three_stage_model(), reshard_after_forward="yes"),
    "reshard_after_forward_float": lambda ns: ns.fully_shard(three_stage_model(), reshard_after_forward=2.0),
    "fsdp_module_inside_ignored_modules": _fsdp_inside_ignored,
    "mixed_ignored_states_types": _mixed_ignored_states,
    "ignored_modules_and_ignored_states": _ignored_modules_and_states,
    "different_use_orig_params": _mixed_use_orig_params,
}


def _outcome(case, lib: str) -> type | None:
    try:
        case(api(lib))
    except Exception as exc:  # noqa: BLE001 - the type is the result
        return type(exc)
    return None


@pytest.mark.parametrize("case", sorted(MISUSE))
@distributed(world_size=2)
def test_misuse_rejected_as_torch(case):
    assert _outcome(MISUSE[case], "torch") is ValueError, "torch changed: update the table"
    assert _outcome(MISUSE[case], "fullshard") is ValueError


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
@distributed(world_size=1)
def test_one_rank_switches_to_no_shard(strategy):
    """One rank: the wrapper warns once, runs as NO_SHARD and trains exactly as the plain model does."""
    reference = three_stage_model()
    runs = {"torch": (train(reference, steps=2), full_state(reference))}
    for lib in ("torch", "fullshard"):
        ns = api(lib)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrapper = ns.FSDP(three_stage_model(), sharding_strategy=getattr(ns.ShardingStrategy, strategy),
                              device_id=CPU)
        switched = [w for w in caught if issubclass(w.category, UserWarning) and "NO_SHARD" in str(w.message)]
        assert len(switched) == 1, (lib, [str(w.message) for w in caught])
        assert wrapper.sharding_strategy.name == "NO_SHARD", lib
        runs["fullshard"] = (train(wrapper, steps=2), full_state(wrapper))
        assert_same_training(runs)  # the plain model's losses and values, under either library


# -- item 12: meta-device initialization -----------------------------------------------------------------
def seeded_init(module: nn.Module) -> None:
    """A per-module param_init_fn (FSDP1 calls it on each module it manages)."""
    module.to_empty(device=CPU, recurse=False)
    if isinstance(module, nn.Linear):
        torch.manual_seed(module.in_features * 10 + module.out_features)
        module.reset_parameters()


def wrap_nested(ns: types.SimpleNamespace, model: nn.Sequential, **kwargs) -> nn.Module:
    model[1] = ns.FSDP(model[1], device_id=CPU, **kwargs)
    return ns.FSDP(model, device_id=CPU, **kwargs)


@pytest.mark.parametrize("init", ["param_init_fn", "reset_parameters"])
@distributed(world_size=2)
def test_wrapper_materializes_meta_modules(init):
    kwargs = {"param_init_fn": seeded_init} if init == "param_init_fn" else {}
    runs = {}
    for lib in ("torch", "fullshard"):
        with torch.device("meta"):
            model = three_stage_model()
        torch.manual_seed(0)
        model = wrap_nested(api(lib), model, **kwargs)
        assert all(p.device == CPU for p in model.parameters()), lib
        runs[lib] = (train(model), full_state(model))
    assert_same_training(runs)
    if init == "param_init_fn":  # the same values as initialising first, then training under torch's DDP
        with torch.device("meta"):
            reference = three_stage_model()
        for module in reference.modules():
            seeded_init(module)
        runs["torch"] = (train(DistributedDataParallel(reference)), full_state(reference))
        assert_same_training(runs)


def load_piece_by_piece(ns: types.SimpleNamespace, full: dict[str, torch.Tensor]) -> nn.Module:
    """fully_shard on meta, then each parameter assigned as a sharded DTensor (a
    torchtitan-style loader that never holds the model twice)."""
    from torch.distributed.tensor import distribute_tensor

    with torch.device("meta"):
        model = three_stage_model()
    for module in (model[1], model):
        ns.fully_shard(module, offload_policy=ns.CPUOffloadPolicy(pin_memory=False))
    for name, value in full.items():
        target = model.state_dict()[name]
        model.load_state_dict({name: distribute_tensor(value, target.device_mesh, target.placements)},
                              strict=False, assign=True)
    return model


@distributed(world_size=2)
def test_fully_shard_meta_model_loaded_with_assign():
    full = three_stage_model().state_dict()
    runs = {lib: load_piece_by_piece(api(lib), full) for lib in ("torch", "fullshard")}
    runs = {lib: (train(model), full_state(model)) for lib, model in runs.items()}
    assert_same_training(runs)
    reference = three_stage_model()  # not on meta, not sharded: torch's DDP averages the ranks' gradients
    runs["torch"] = (train(DistributedDataParallel(reference)), full_state(reference))
    assert_same_training(runs)


# -- torch 2.13: fully_shard([module_a, module_b]) ----------------------------------------------------------
class TinyLM(nn.Module):
    """torchtitan's shape: embeddings, blocks, final norm, output head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.norm = nn.LayerNorm(8)
        self.output = nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.output(self.norm(h))


def train_lm(model: nn.Module, steps: int = 3) -> list[float]:
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 16, (2, 5))
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("reshard_after_forward", [True, False])
@distributed(world_size=2)
def test_one_unit_over_several_modules(reshard_after_forward):
    from fullshard import set_all_gather_bucket_size
    from fullshard._core import comm

    runs = {}
    for lib in ("torch", "fullshard"):
        shard = api(lib).fully_shard
        model = TinyLM()
        for layer in model.layers:
            shard(layer, reshard_after_forward=reshard_after_forward)
        grouped = [model.embed, model.norm, model.output]
        assert shard(grouped, reshard_after_forward=reshard_after_forward) is grouped
        shard(model)
        assert shard.state(model.embed) is shard.state(model.output), lib
        assert type(model.norm).__name__ == "FSDPLayerNorm", lib
        runs[lib] = (train_lm(model), full_state(model))
        if lib == "fullshard":  # one all-gather per unit and forward: the group's three modules share one
            set_all_gather_bucket_size(model, 0)  # (gathered unit by unit, not in buckets)
            with comm.record_comms() as records, torch.no_grad():
                model(torch.zeros(2, 5, dtype=torch.long))
            assert sum(r.op == "all_gather" for r in records) == 3
    assert_same_training(runs)


# -- torch 2.13: fully_shard(..., shard_placement_fn=fn) -------------------------------------------------
def dim1_for_matrices(param: nn.Parameter):
    from torch.distributed.tensor import Shard

    return Shard(1) if param.ndim == 2 else None  # None: dim 0


def local_shapes(model: nn.Module) -> list[tuple]:
    return [(n, tuple(p.to_local().shape), tuple(p.placements)) for n, p in model.named_parameters()]


@distributed(world_size=2)
def test_shard_placement_fn_as_torch():
    """Even sizes (torch supports no other on dims but 0): the same shards and training."""
    runs, shapes = {}, {}
    for lib in ("torch", "fullshard"):
        model = three_stage_model()
        for module in (model[1], model):
            api(lib).fully_shard(module, shard_placement_fn=dim1_for_matrices)
        shapes[lib] = local_shapes(model)
        runs[lib] = (train(model), full_state(model))
    assert shapes["torch"] == shapes["fullshard"]
    assert ("0.weight", (8, 2), (torch.distributed.tensor.Shard(1),)) in shapes["fullshard"]
    assert_same_training(runs)


class Experts(nn.Module):
    """Expert weights (expert, in, out) sharded on dims that split unevenly."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w_in = nn.Parameter(torch.randn(3, 4, 5) * 0.3)  # dim 2: 5 = 3 + 2 rows
        self.w_out = nn.Parameter(torch.randn(3, 5, 4) * 0.3)  # dim 1: 5 = 3 + 2
        self.gate = nn.Parameter(torch.ones(4, 1))  # dim 1: 1 = 1 + 0 (rank 1 holds padding only)
        self.proj = nn.Linear(4, 4)  # dim 0 (None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.einsum("bi,eih->beh", x * self.gate.squeeze(1), self.w_in).relu()
        return self.proj(torch.einsum("beh,eho->bo", h, self.w_out))


def experts_placement(param: nn.Parameter):
    from torch.distributed.tensor import Shard

    if param.ndim == 3:
        return Shard(-1) if param.shape[-1] == 5 else Shard(1)
    return Shard(1) if param.shape == (4, 1) else None


@distributed(world_size=2)
def test_shard_placement_fn_uneven_against_single_process():
    """Uneven dims torch rejects: training equal to one process, state dicts right."""
    from fullshard.testing import DataParallelReference, assert_params_equal

    model, reference = Experts(), Experts()
    fullshard.fully_shard(model, shard_placement_fn=experts_placement)
    rank = dist.get_rank()
    assert [tuple(p.to_local().shape) for p in model.parameters()] == (
        [(3, 4, 3), (3, 3, 4), (4, 1), (2, 4), (2,)] if rank == 0 else [(3, 4, 2), (3, 2, 4), (4, 0), (2, 4), (2,)]
    )
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_optim = torch.optim.Adam(reference.parameters(), lr=0.01)
    loss_fn = lambda m, batch: m(batch[0]).square().mean()  # noqa: E731
    ref = DataParallelReference(reference, loss_fn)
    for step in range(3):
        torch.manual_seed(100 + step)
        batches = [(torch.randn(3, 4),) for _ in range(2)]
        loss = loss_fn(model, batches[rank])
        loss.backward()
        ref.backward(batches)
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        torch.testing.assert_close(full_value(model.w_in), reference.w_in.detach())
    assert_params_equal(model, reference)
    state = model.state_dict()
    assert state["w_in"].placements == (torch.distributed.tensor.Shard(2),)
    fresh = Experts()
    fullshard.fully_shard(fresh, shard_placement_fn=experts_placement)
    fresh.load_state_dict(state)
    assert_params_equal(fresh, reference)
    with torch.no_grad():  # a forward after loading gathers the loaded values
        torch.testing.assert_close(fresh(torch.ones(2, 4)), reference(torch.ones(2, 4)))


class Skipping(nn.Module):
    """``head`` runs only on odd steps: the grouped unit's pass then ends with the root's forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.head = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step += 1
        h = self.mid(torch.relu(self.inp(x)))
        return self.head(h) if self.step % 2 else h[:, :4]


@distributed(world_size=2)
def test_one_unit_with_a_module_that_does_not_run():
    runs = {}
    for lib in ("torch", "fullshard"):
        model = Skipping()
        api(lib).fully_shard(model.mid)
        api(lib).fully_shard([model.inp, model.head])
        api(lib).fully_shard(model)
        runs[lib] = (train(model, steps=4), full_state(model))
    assert_same_training(runs)
