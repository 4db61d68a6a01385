"""FSDP1's older optimizer-state calls (full/sharded/shard/scatter/flatten/rekey), with
torch's FullyShardedDataParallel as the oracle on the same model, data and optimizer."""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from fullshard import FSDP, OptimStateKeyType
from fullshard.testing import clone_tree, distributed
from fullshard.wrap import ModuleWrapPolicy

CPU = torch.device("cpu")
OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.lin2 = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin2(torch.relu(self.lin(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(3, 4)
        self.block = Block()
        self.head = nn.Linear(3, 2, bias=False)

    def forward(self, x):
        return self.head(self.block(self.emb(x)))


def plain() -> Net:
    torch.manual_seed(0)
    return Net()


def ours(use_orig_params: bool) -> nn.Module:
    return FSDP(plain(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=CPU, use_orig_params=use_orig_params)


def theirs(use_orig_params: bool) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TorchFSDP(plain(), auto_wrap_policy=TorchPolicy({Block}), device_id=CPU, use_orig_params=use_orig_params)


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
        model(x).square().sum().backward()
        optim.step()
        optim.zero_grad()


def assert_same_osd(ours_osd: dict, torch_osd: dict, skip: tuple[str, ...] = (), param_groups: bool = True) -> None:
    assert set(ours_osd) == set(torch_osd)
    if not torch_osd:
        return
    assert set(ours_osd["state"]) == set(torch_osd["state"])
    for key, values in torch_osd["state"].items():
        assert set(ours_osd["state"][key]) == set(values), key
        for name, value in values.items():
            if name not in skip:
                torch.testing.assert_close(ours_osd["state"][key][name], value, msg=lambda m: f"{key}.{name}: {m}")
    if param_groups:
        assert ours_osd["param_groups"] == torch_osd["param_groups"]


def assert_same_params(a: nn.Module, b: nn.Module) -> None:
    sd_a, sd_b = a.state_dict(), b.state_dict()  # the wrapper's default: full tensors
    assert set(sd_a) == set(sd_b)
    for key in sd_a:
        torch.testing.assert_close(sd_a[key], sd_b[key], msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize(
    "use_orig_params,optimizer", [(False, "adam"), (True, "adam"), (False, "sgd")], ids=["flat-adam", "orig-adam", "flat-sgd"]
)
@distributed(world_size=2)
def test_full_optim_state_dict_matches_torch(use_orig_params, optimizer):
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    model, reference = ours(use_orig_params), theirs(use_orig_params)
    optim, ref_optim = OPTIMIZERS[optimizer](model.parameters()), OPTIMIZERS[optimizer](reference.parameters())
    train(model, optim, range(2))
    train(reference, ref_optim, range(2))
    # torch 2.13's use_orig_params=True full dict (CPU, gloo) has exp_avg_sq's values under
    # exp_avg too; its flat-parameter dict (same training) is the oracle for the values.
    flat_reference = theirs(False) if use_orig_params else reference
    if use_orig_params:
        flat_optim = OPTIMIZERS[optimizer](flat_reference.parameters())
        train(flat_reference, flat_optim, range(2))
    for rank0_only in (True, False):
        osd = FSDP.full_optim_state_dict(model, optim, rank0_only=rank0_only)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = TorchFSDP.full_optim_state_dict(reference, ref_optim, rank0_only=rank0_only)
            if use_orig_params:
                values = TorchFSDP.full_optim_state_dict(flat_reference, flat_optim, rank0_only=rank0_only)
        assert_same_osd(osd, expected, skip=("exp_avg",) if use_orig_params else ())
        if use_orig_params:
            assert_same_osd(osd, values, param_groups=False)  # flat order lists the root unit first
        assert (osd == {}) == (rank0_only and dist.get_rank() == 1)
    # The model's own state-dict settings are left as they were.
    assert FSDP.get_state_dict_type(model).state_dict_type.name == "FULL_STATE_DICT"
    with pytest.warns(FutureWarning, match="optim_input"):
        FSDP.full_optim_state_dict(model, optim, optim_input=list(model.parameters()))
    other_group = dist.new_group(list(range(dist.get_world_size())))  # not the model's own (which is not warned of)
    with pytest.warns(UserWarning, match="full_optim_state_dict ignores group"):
        FSDP.full_optim_state_dict(model, optim, group=other_group)


@pytest.mark.parametrize("how", ["shard", "shard-no-optim", "shard-optim-input", "scatter", "scatter-group"])
@pytest.mark.parametrize("use_orig_params", [False, True])
@distributed(world_size=2)
def test_full_optim_state_dict_round_trip(use_orig_params, how):
    model = ours(use_orig_params)
    optim = OPTIMIZERS["adam"](model.parameters())
    train(model, optim, range(2))
    model_sd = clone_tree(model.state_dict())
    full = clone_tree(FSDP.full_optim_state_dict(model, optim, rank0_only=how.startswith("scatter")))

    other = ours(use_orig_params)
    other.load_state_dict(model_sd)
    other_optim = OPTIMIZERS["adam"](other.parameters())
    if how == "shard":
        loadable = FSDP.shard_full_optim_state_dict(full, other, optim=other_optim)
    elif how == "shard-no-optim":  # the optimizer was built from model.parameters()
        loadable = FSDP.shard_full_optim_state_dict(full, other)
    elif how == "shard-optim-input":  # the optimizer's constructor argument
        with pytest.warns(FutureWarning, match="optim_input"):
            loadable = FSDP.shard_full_optim_state_dict(full, other, optim_input=list(other.parameters()))
    else:
        group = dist.group.WORLD if how == "scatter-group" else None
        given = full if dist.get_rank() == 0 else None
        loadable = FSDP.scatter_full_optim_state_dict(given, other, optim=other_optim, group=group)
    assert all(isinstance(k, int) for k in loadable["state"])
    assert [g["params"] for g in loadable["param_groups"]] == [g["params"] for g in other_optim.state_dict()["param_groups"]]
    other_optim.load_state_dict(loadable)
    train(model, optim, range(2, 3))
    train(other, other_optim, range(2, 3))
    assert_same_params(model, other)


@distributed(world_size=2)
def test_shard_full_optim_state_dict_loads_torchs_full_dict():
    """A full dict saved by torch's FSDP1 loads into our wrapper and continues identically."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    reference = theirs(False)
    ref_optim = OPTIMIZERS["adam"](reference.parameters())
    train(reference, ref_optim, range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = clone_tree(TorchFSDP.full_optim_state_dict(reference, ref_optim, rank0_only=False))
        model_sd = clone_tree(reference.state_dict())
    model = ours(True)
    model.load_state_dict(model_sd)
    optim = OPTIMIZERS["adam"](model.parameters())
    optim.load_state_dict(FSDP.shard_full_optim_state_dict(full, model, optim=optim))
    train(reference, ref_optim, range(2, 3))
    train(model, optim, range(2, 3))
    assert_same_params(model, reference)
    with pytest.raises(ValueError, match="PARAM_NAME"):
        FSDP.shard_full_optim_state_dict({"state": {0: {}}, "param_groups": [{"params": [0]}]}, model)


@distributed(world_size=2)
def test_rekey_optim_state_dict_matches_torch():
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import OptimStateKeyType as TorchKeyType

    model = ours(False)
    optim = OPTIMIZERS["adam"](model.parameters())
    train(model, optim, range(2))
    full = clone_tree(FSDP.full_optim_state_dict(model, optim, rank0_only=False))
    net = plain()
    net_optim = OPTIMIZERS["adam"](net.parameters())
    by_id = FSDP.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_ID, net)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected_id = TorchFSDP.rekey_optim_state_dict(full, TorchKeyType.PARAM_ID, net)
        expected_name = TorchFSDP.rekey_optim_state_dict(expected_id, TorchKeyType.PARAM_NAME, net)
    assert_same_osd(by_id, expected_id)
    assert FSDP.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_ID, net, optim=net_optim) == by_id
    net_optim.load_state_dict(by_id)  # an unwrapped model's optimizer takes it
    by_name = FSDP.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, net)
    assert_same_osd(by_name, expected_name)
    # Back to the original: same states; param groups list their names sorted (like torch's).
    assert_same_osd(by_name, {**full, "param_groups": [{**g, "params": sorted(g["params"])} for g in full["param_groups"]]})
    # torch's own enum members are accepted too (mixed imports).
    assert FSDP.rekey_optim_state_dict(full, TorchKeyType.PARAM_ID, net) == by_id
    # Already keyed so: returned as is.
    assert FSDP.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_NAME, net) is full
    assert FSDP.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_ID, net) is by_id
    # A flat parameter's state is no single parameter's (RuntimeError: torch's type).
    with pytest.raises(RuntimeError, match="flat parameter"):
        FSDP.rekey_optim_state_dict(optim.state_dict(), OptimStateKeyType.PARAM_NAME, model)


@distributed(world_size=2)
def test_rekey_own_state_dict_with_orig_params():
    """use_orig_params=True: the optimizer's own (index-keyed) dict rekeys to names and back."""
    model = ours(True)
    optim = OPTIMIZERS["adam"](model.parameters())
    train(model, optim, range(1))
    own = optim.state_dict()
    by_name = FSDP.rekey_optim_state_dict(own, OptimStateKeyType.PARAM_NAME, model, optim=optim)
    assert set(by_name["state"]) == {n for n, _ in plain().named_parameters()}
    back = FSDP.rekey_optim_state_dict(by_name, OptimStateKeyType.PARAM_ID, model, optim=optim)
    assert back["state"].keys() == own["state"].keys() and back["param_groups"] == own["param_groups"]
    for index, values in own["state"].items():
        assert all(back["state"][index][k] is v for k, v in values.items())


@pytest.mark.parametrize("use_orig_params", [False, True])
@distributed(world_size=2)
def test_sharded_optim_state_dict_round_trip(use_orig_params):
    model = ours(use_orig_params)
    optim = OPTIMIZERS["adam"](model.parameters())
    train(model, optim, range(2))
    model_sd = clone_tree(model.state_dict())
    sharded = clone_tree(FSDP.sharded_optim_state_dict(model, optim))
    # As torch's (no device mesh given): ShardedTensors.
    assert all(isinstance(v["exp_avg"], ShardedTensor) for v in sharded["state"].values())
    assert FSDP.get_state_dict_type(model).state_dict_type.name == "FULL_STATE_DICT"
    others = []
    for convert in (FSDP.optim_state_dict_to_load, FSDP.flatten_sharded_optim_state_dict):
        other = ours(use_orig_params)
        other.load_state_dict(model_sd)
        other_optim = OPTIMIZERS["adam"](other.parameters())
        osd = clone_tree(sharded)  # loaded optimizers may share the dict's tensors (e.g. step)
        if convert is FSDP.optim_state_dict_to_load:
            other_optim.load_state_dict(convert(other, other_optim, osd))
        else:
            other_optim.load_state_dict(convert(osd, other, other_optim))
        others.append((other, other_optim))
    train(model, optim, range(2, 3))
    for other, other_optim in others:
        train(other, other_optim, range(2, 3))
        assert_same_params(model, other)



def clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def _partial_optimizer_calls(model: nn.Module, optim: torch.optim.Optimizer, lib) -> dict[str, str]:
    """Each FSDP1 optimizer-state call on ``optim``: the exception's type name, or "ok"."""
    calls = {
        "optim_state_dict": lambda: lib.optim_state_dict(model, optim),
        "full_optim_state_dict": lambda: lib.full_optim_state_dict(model, optim),
        "sharded_optim_state_dict": lambda: lib.sharded_optim_state_dict(model, optim),
    }
    outcome = {}
    for name, call in calls.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                call()
            outcome[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - the outcome is what is compared
            outcome[name] = type(exc).__name__
            if lib is FSDP:
                assert "block.lin.weight" in str(exc) and "unit of their own" in str(exc), str(exc)
    return outcome


@distributed(world_size=2)
def test_optimizer_with_part_of_a_units_parameters_raises_as_torch():
    """use_orig_params=True: an optimizer with states for some of a unit's trainable parameters (block.lin's
    weight left out) makes FSDP1's optimizer-state calls raise RuntimeError; none or all of them is fine,
    and so is an optimizer keeping no tensor state (SGD without momentum)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    for kind, expected in (("adam", "RuntimeError"), ("sgd", "RuntimeError"), ("plain_sgd", "ok")):
        outcomes = []
        for make, lib in ((theirs, TorchFSDP), (ours, FSDP)):
            model = make(True)
            part = [p for name, p in model.named_parameters() if clean(name) != "block.lin.weight"]
            if kind == "plain_sgd":
                optim = torch.optim.SGD(part, lr=1e-2)
            else:
                optim = OPTIMIZERS[kind](part)
            train(model, optim, range(1))
            outcomes.append(_partial_optimizer_calls(model, optim, lib))
        assert outcomes[0] == outcomes[1] == dict.fromkeys(outcomes[0], expected), (kind, outcomes)
    model = ours(True)  # the whole unit left out: no error
    optim = OPTIMIZERS["adam"]([p for name, p in model.named_parameters() if not clean(name).startswith("block.")])
    train(model, optim, range(1))
    assert set(_partial_optimizer_calls(model, optim, FSDP).values()) == {"ok"}
