"""``fullshard.use_in_place_of_torch()``: torch's FSDP names resolve to fullshard's, until undone."""

import importlib

import torch.distributed._composable.fsdp as composable_fsdp
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp.sharded_grad_scaler  # noqa: F401  (imported by the rebinding: present before and after)
import torch.distributed.fsdp.wrap as torch_wrap
import torch.nn as nn

import fullshard
import fullshard.wrap
from fullshard.testing import distributed
from fullshard.testing.harness import run_in_fresh_process
from fullshard.torch_names import TORCH_MODULES


def _torch_names() -> dict[tuple[str, str], object]:
    found = {}
    for path in TORCH_MODULES:
        module = importlib.import_module(path)
        for name in dir(module):
            if not name.startswith("_"):
                found[(path, name)] = getattr(module, name)
    return found


def test_public_names_resolve_to_fullshard_and_come_back():
    before = _torch_names()
    with fullshard.use_in_place_of_torch():
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, ShardingStrategy, fully_shard
        from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType

        assert fully_shard is fullshard.fully_shard and FSDPModule is fullshard.FSDPModule
        assert FullyShardedDataParallel is fullshard.FullyShardedDataParallel
        assert ShardingStrategy is fullshard.ShardingStrategy and StateDictType is fullshard.StateDictType
        for name in torch_fsdp.__all__:  # every public name fullshard has (all of them: see test_torch_surface)
            assert getattr(torch_fsdp, name) is getattr(fullshard, name), name
        for name in torch_wrap.__all__:
            assert getattr(torch_wrap, name) is getattr(fullshard.wrap, name), name
        assert composable_fsdp.fully_shard is fullshard.fully_shard
        assert composable_fsdp.FSDPModule is fullshard.FSDPModule
        assert torch_fsdp.wrap is torch_wrap  # submodules stay modules
        assert importlib.import_module("torch.distributed.fsdp.sharded_grad_scaler").ShardedGradScaler is (
            fullshard.ShardedGradScaler
        )
    assert _torch_names() == before


def test_undo_and_nesting():
    original = torch_fsdp.fully_shard
    outer = fullshard.use_in_place_of_torch()
    inner = fullshard.use_in_place_of_torch()  # nothing left to rebind: undoing it changes nothing
    inner.undo()
    assert torch_fsdp.fully_shard is fullshard.fully_shard
    outer.undo()
    assert torch_fsdp.fully_shard is original
    fullshard.use_in_place_of_torch()
    fullshard.restore_torch_names()
    assert torch_fsdp.fully_shard is original


@distributed(world_size=2)
def test_a_library_looking_for_torchs_class_finds_our_units():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fullshard.fully_shard(model[0])
    fullshard.fully_shard(model)
    assert not any(isinstance(m, torch_fsdp.FSDPModule) for m in model.modules())
    with fullshard.use_in_place_of_torch():
        from torch.distributed.fsdp import FSDPModule  # as a library does, at its import or call

        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        assert units == [model, model[0]]
        for unit in units:
            unit.set_requires_gradient_sync(False)  # the methods a library calls are ours
        assert all(not g.settings.requires_gradient_sync for u in units for g in u._groups(recurse=False))


def test_undo_restores_modules_first_imported_by_the_rebinding():
    """A torch module imported for the first time while names are rebound would copy ours (in a
    process that has not imported torch's FSDP yet, as this one has: a script, not a function of
    this module, whose import would bring torch's FSDP along)."""
    script = (
        "import fullshard, sys\n"
        "assert 'torch.distributed._composable.fsdp' not in sys.modules\n"
        "fullshard.use_in_place_of_torch().undo()\n"
        "import torch.distributed._composable.fsdp as C, torch.distributed.fsdp as T\n"
        "assert C.FSDPModule is T.FSDPModule is not fullshard.FSDPModule\n"
        "assert C.fully_shard is T.fully_shard is not fullshard.fully_shard\n"
    )
    run_in_fresh_process(exec, script, {})
