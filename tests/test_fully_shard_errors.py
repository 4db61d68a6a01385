"""Bad input gets a clear exception naming the module or parameter, and never a hang."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fullshard import fully_shard, register_fsdp_forward_method, replicate
from fullshard.models import MLP
from fullshard.testing import case, distributed


@distributed(world_size=2)
def test_fully_shard_twice_on_one_module():
    model = MLP(4)
    fully_shard(model)
    with pytest.raises(ValueError, match=r"^fully_shard expects a module that fully_shard/replicate has not been applied to, but MLP already has"):
        fully_shard(model)
    with pytest.raises(ValueError, match=r"^replicate expects .* but MLP already has"):
        replicate(model)


@distributed(world_size=1)
def test_not_a_module():
    with pytest.raises(TypeError, match=r"^fully_shard expects an nn.Module but got Tensor$"):
        fully_shard(torch.ones(2))
    with pytest.raises(TypeError, match=r"^fully_shard expects a DeviceMesh for mesh but got str$"):
        fully_shard(MLP(4), mesh="cpu")


@distributed(world_size=2)
def test_replicate_needs_1d_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    with pytest.raises(ValueError, match=r"^replicate expects a 1D DeviceMesh but got DeviceMesh\(\[\[0\], \[1\]\]\)$"):
        replicate(MLP(4), mesh=init_device_mesh("cpu", (2, 1)))


@distributed(world_size=2)
def test_parameters_on_different_devices():
    model = MLP(4)
    with torch.device("meta"):
        model.out_proj = nn.Linear(16, 4)
    with pytest.raises(ValueError, match=r"all parameters of MLP on one device but got: in_proj.weight on cpu, .*out_proj.weight on meta"):
        fully_shard(model)


@distributed(world_size=2)
def test_ignored_params_not_in_module_are_skipped():
    """As torch: one ignore list may serve several units (see test_torch_parity_init)."""
    model = fully_shard(MLP(4), ignored_params={nn.Parameter(torch.ones(3, 3))})
    assert all(hasattr(p, "placements") for p in model.parameters())


@distributed(world_size=2)
def test_ignored_params_stay_local():
    torch.manual_seed(0)
    model = MLP(4)
    ignored = model.out_proj.bias
    fully_shard(model, ignored_params={ignored})
    assert model.out_proj.bias is ignored and not hasattr(ignored, "placements")
    model(torch.ones(2, 4) * (dist.get_rank() + 1)).sum().backward()
    # Not reduced: each rank keeps the gradient of its own data.
    assert torch.equal(ignored.grad, torch.full((4,), 2.0))
    assert hasattr(model.out_proj.weight, "placements")


@distributed(world_size=2)
def test_reshard_after_forward_wrong_type():
    with pytest.raises(ValueError, match=r"reshard_after_forward to be None, a bool or an int but got 'yes' \(str\) for MLP"):
        fully_shard(MLP(4), reshard_after_forward="yes")


def _with_scalar() -> MLP:
    model = MLP(4)
    model.scale = nn.Parameter(torch.tensor(1.0))
    return model


def _shard_child_after_parent(prepare=lambda model: None) -> None:
    model = nn.Sequential(MLP(4), MLP(4))
    fully_shard(model)
    prepare(model)
    fully_shard(model[1])


# One behaviour per row: (exception type, message pattern, the call that must raise it); the
# messages name the call the user made and that call's own arguments.
PARAMETER_ERRORS = {
    # As torch's fully_shard: ValueError (test_torch_raises_value_error_for_scalar_parameters).
    "scalar_parameter": (
        ValueError, r"^fully_shard expects parameters with at least one dimension but got the 0-dim scale of MLP; "
        r"reshape it to \(1,\) or pass it in ignored_params$",
        lambda: fully_shard(_with_scalar())),
    "scalar_parameter_replicate": (
        ValueError, r"^replicate expects parameters with at least one dimension .* pass it in ignored_params$",
        lambda: replicate(_with_scalar())),
    # Torch 2.13's fully_shard fails here with "TypeError: Invariant encountered: value was None".
    "already_sharded_by_parent": (
        ValueError, r"^fully_shard expects parameters that no unit shards yet, but in_proj.weight of MLP is "
        r"already sharded by fully_shard on Sequential; apply fully_shard to submodules before their parents",
        _shard_child_after_parent),
    "already_sharded_after_half": (  # .half() replaced the sharded parameters with new DTensors
        ValueError, r"^fully_shard expects parameters that no unit shards yet, but in_proj.weight of MLP",
        lambda: _shard_child_after_parent(lambda model: model.half())),
}


@distributed(world_size=2)
def test_parameter_errors():
    for name, (error, match, call) in PARAMETER_ERRORS.items():
        with case(name), pytest.raises(error, match=match):
            call()


@distributed(world_size=1)
def test_torch_raises_value_error_for_scalar_parameters():
    """The oracle for the rows above: torch's fully_shard and FSDP1 raise ValueError too."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    with pytest.raises(ValueError, match="scalar parameters"):
        torch_fully_shard(_with_scalar())
    with pytest.raises(ValueError, match="scalar parameters"):
        TorchFSDP(_with_scalar(), device_id=torch.device("cpu"))


@distributed(world_size=2)
def test_parameter_shared_by_two_units():
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight  # tied
    fully_shard(model[0])
    with pytest.raises(ValueError, match=r"managed by one unit, but a parameter of Linear is already managed by another \(fully_shard on Embedding\)"):
        fully_shard(model[1])


@distributed(world_size=2)
def test_register_fsdp_forward_method_errors():
    with pytest.raises(ValueError, match=r"expects a module that fully_shard was applied to, but got MLP"):
        register_fsdp_forward_method(MLP(4), "forward")
    model = fully_shard(MLP(4))
    with pytest.raises(ValueError, match=r"expects MLP to have a method 'generate'"):
        register_fsdp_forward_method(model, "generate")


@distributed(world_size=2)
def test_forward_after_process_group_destroyed():
    model = nn.Sequential(MLP(4), MLP(4))
    fully_shard(model[0], reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    model(torch.ones(2, 4)).sum().backward()
    dist.destroy_process_group()
    with pytest.raises(RuntimeError, match=r"default process group was destroyed"):
        model(torch.ones(2, 4))


@distributed(world_size=2)
def test_deepcopy_after_fully_shard():
    import copy

    model = fully_shard(MLP(4))
    with pytest.raises(NotImplementedError, match="deep-copy the model before applying fully_shard"):
        copy.deepcopy(model)
