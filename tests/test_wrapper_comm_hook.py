"""``FullyShardedDataParallel.register_comm_hook``: torch's own FSDP hooks (plain,
fp16-compressed, all-reduce) give the same training as in torch's FSDP1; a custom
hook sees each unit's gradient once per backward; misuse is refused."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._comm_hooks import default_hooks

from fullshard import FSDP, ShardingStrategy, StateDictType
from fullshard.models import ModelArgs, Transformer, TransformerBlock
from fullshard.wrap import ModuleWrapPolicy
from fullshard.testing import case, distributed

CPU = torch.device("cpu")
ARGS = ModelArgs(n_layers=2, vocab_size=32, max_seq_len=8, dim=16)


def make_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ARGS)


def train_two_steps(model: nn.Module) -> None:
    optim = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(2):
        generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        tokens = torch.randint(ARGS.vocab_size, (4, ARGS.max_seq_len), generator=generator)
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, dims=1).flatten()).backward()
        optim.step()
        optim.zero_grad()


def full_state(model: nn.Module, fsdp_class, full_type) -> dict[str, torch.Tensor]:
    """The model's full state dict, keys without wrapper prefixes."""
    with fsdp_class.state_dict_type(model, full_type):
        return {k.replace("_fsdp_wrapped_module.", ""): v.clone() for k, v in model.state_dict().items()}


def fp16_compress_hook(state: default_hooks.DefaultState, grad: torch.Tensor, output: torch.Tensor) -> None:
    """torch's ``fp16_compress_hook`` for CPU tensors (torch's calls ``record_stream``,
    which only accelerator tensors have): communicate in fp16, average, cast back."""
    compressed = grad.to(torch.float16).div_(state.gradient_predivide_factor)
    reduced = torch.empty_like(output, dtype=torch.float16)
    dist.reduce_scatter_tensor(reduced, compressed, group=state.process_group)
    output.copy_(reduced.div_(state.gradient_postdivide_factor))


HOOKS = {
    "reduce_scatter": (default_hooks.DefaultState, default_hooks.reduce_scatter_hook, ShardingStrategy.FULL_SHARD),
    "fp16_compress": (default_hooks.DefaultState, fp16_compress_hook, ShardingStrategy.SHARD_GRAD_OP),
    "allreduce": (default_hooks.DefaultState, default_hooks.allreduce_hook, ShardingStrategy.NO_SHARD),
}


@pytest.mark.parametrize("name", list(HOOKS))
@distributed(world_size=2)
def test_torch_hooks_train_like_torch_fsdp1(name):
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    from torch.distributed.fsdp import StateDictType as TorchStateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    make_state, hook, strategy = HOOKS[name]
    ours = FSDP(make_model(), sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                device_id=CPU)
    theirs = TorchFSDP(make_model(), sharding_strategy=TorchStrategy[strategy.name],
                       auto_wrap_policy=TorchPolicy({TransformerBlock}), device_id=CPU)
    unhooked = FSDP(make_model(), sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                    device_id=CPU)
    ours.register_comm_hook(make_state(dist.group.WORLD), hook)
    theirs.register_comm_hook(make_state(dist.group.WORLD), hook)
    for model in (ours, theirs, unhooked):
        train_two_steps(model)
    ours_state = full_state(ours, FSDP, StateDictType.FULL_STATE_DICT)
    theirs_state = full_state(theirs, TorchFSDP, TorchStateDictType.FULL_STATE_DICT)
    assert ours_state.keys() == theirs_state.keys()
    for key in ours_state:
        torch.testing.assert_close(ours_state[key], theirs_state[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    tolerance = {"rtol": 1e-2, "atol": 1e-3} if name == "fp16_compress" else {"rtol": 1e-5, "atol": 1e-6}
    for key, value in full_state(unhooked, FSDP, StateDictType.FULL_STATE_DICT).items():  # the hook averages as the default path does
        torch.testing.assert_close(ours_state[key], value, **tolerance, msg=lambda m: f"{key}: {m}")


@distributed(world_size=2)
def test_custom_hook_sees_each_unit_once():
    calls = []

    def hook(state, grad, output):
        calls.append((grad.numel(), output.numel()))
        default_hooks.reduce_scatter_hook(state, grad, output)

    model = FSDP(make_model(), auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}), device_id=CPU)
    model.register_comm_hook(default_hooks.DefaultState(dist.group.WORLD), hook)
    train_two_steps(model)
    assert len(calls) == 2 * (1 + ARGS.n_layers)
    assert all(grad == 2 * output for grad, output in calls)


def _wrapped() -> FSDP:
    return FSDP(make_model(), auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}), device_id=CPU)


def _hook_on_a_layer(state) -> None:
    model = _wrapped()
    assert model.check_is_root()  # initializes the tree from the top; then the layers are not roots
    model.module.layers[0].register_comm_hook(state, default_hooks.reduce_scatter_hook)


def _hook_twice(state) -> None:
    model = _wrapped()
    assert model.check_is_root()
    model.register_comm_hook(state, default_hooks.reduce_scatter_hook)
    model.register_comm_hook(state, default_hooks.reduce_scatter_hook)


def _hook_on_hybrid(state) -> None:
    hybrid = FSDP(make_model(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_id=CPU,
                  device_mesh=_mesh_1x2(), auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
    hybrid.register_comm_hook(state, default_hooks.reduce_scatter_hook)


# One behaviour per row: (exception type, message pattern, the call that must raise it, given the
# hook state), all in one distributed body so the table costs one task. The types and the anchored
# words are torch 2.13's FSDP1's (its test_fsdp_comm_hooks matches them).
COMM_HOOK_ERRORS = {
    "hook_not_callable": (ValueError, "^The communication hook must be callable",
                          lambda state: _wrapped().register_comm_hook(state, "reduce_scatter")),
    "hook_on_a_non_root": (AssertionError, r"^register_comm_hook can only be called on a root instance\.$",
                           _hook_on_a_layer),
    "hook_registered_twice": (AssertionError, "^A communication hook is already registered$", _hook_twice),
    "hook_with_hybrid_shard": (AssertionError, "^Communication hook is not supported for hybrid strategies: ",
                               _hook_on_hybrid),
}


@distributed(world_size=2)
def test_register_comm_hook_errors():
    state = default_hooks.DefaultState(dist.group.WORLD)
    for name, (error, match, call) in COMM_HOOK_ERRORS.items():
        with case(name), pytest.raises(error, match=match):
            call(state)


def _mesh_1x2():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))

