"""Checkpoints on disk: resume, resharding across world sizes and strategies, atomicity, damage."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fullshard import FSDP, ShardingStrategy, fully_shard
from fullshard import checkpoint as ckpt
from fullshard.models import ModelArgs, Transformer, TransformerBlock
from fullshard.testing import RankFailure, run_distributed
from fullshard.wrap import ModuleWrapPolicy

ARGS = ModelArgs(n_layers=2, vocab_size=32, max_seq_len=8, dim=16)
GLOBAL_BATCH = 8


def make_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ARGS)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(ARGS.vocab_size, (GLOBAL_BATCH, 8), generator=torch.Generator().manual_seed(step))
    return tokens, tokens.roll(-1, dims=1)


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> list[float]:
    """Trains on this rank's slice of each global batch; returns the global losses."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    losses = []
    for step in steps:
        tokens, targets = (t.chunk(world)[rank] for t in global_batch(step))
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        loss = loss.detach()
        if dist.is_initialized():
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return losses


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _full_shard_train_save_continue(path: str) -> list[float]:
    model = make_model()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = adamw(model)
    train(model, optim, range(3))
    ckpt.save(path, model, optim, extra={"step": 3})
    return train(model, optim, range(3, 5))


def _hybrid_load_continue_save(path: str, resaved: str) -> list[float]:
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # two "nodes" of one rank: replicate across both
    model = FSDP(make_model(seed=1), sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_id=torch.device("cpu"),
                 auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
    optim = adamw(model)
    assert ckpt.load(path, model, optim) == {"step": 3}
    ckpt.save(resaved, model, optim, extra={"step": 3})
    return train(model, optim, range(3, 5))


def test_resume_across_world_sizes_and_strategies(tmp_path):
    """4 ranks FULL_SHARD -> 2 ranks HYBRID -> 1 plain process: the same losses as uninterrupted."""
    path, resaved = str(tmp_path / "ckpt"), str(tmp_path / "resaved")
    expected = run_distributed(_full_shard_train_save_continue, 4, path)[0]
    hybrid = run_distributed(_hybrid_load_continue_save, 2, path, resaved)[0]
    torch.testing.assert_close(hybrid, expected, rtol=1e-5, atol=1e-6)
    # A plain model in this (non-distributed) process.
    model = make_model(seed=2)
    optim = adamw(model)
    assert ckpt.load(resaved, model, optim) == {"step": 3}
    torch.testing.assert_close(train(model, optim, range(3, 5)), expected, rtol=1e-5, atol=1e-6)


class WithLateHead(nn.Module):
    """A transformer whose extra head joins training only from ``late_from`` on:
    until then its parameters have no optimizer state."""

    def __init__(self, seed: int = 0, late_from: int = 3) -> None:
        super().__init__()
        self.body = make_model(seed)
        torch.manual_seed(seed + 100)
        self.late_head = nn.Linear(ARGS.vocab_size, ARGS.vocab_size)
        self.late_from, self.step = late_from, 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.body(tokens)
        self.step += 1
        return self.late_head(logits) if self.step > self.late_from else logits


def _late_head_run(path: str, sharded: bool, resume: bool) -> list[float]:
    model = WithLateHead(seed=1 if resume else 0)
    if sharded:
        for layer in model.body.layers:
            fully_shard(layer)
        fully_shard(model)
    optim = adamw(model)
    if not resume:
        train(model, optim, range(3))
        ckpt.save(path, model, optim)
        return train(model, optim, range(3, 6))
    ckpt.load(path, model, optim)
    model.step = 3
    late = {id(p) for p in model.late_head.parameters()}
    assert not any(id(p) in late for p in optim.state), "the late head got placeholder optimizer states"
    return train(model, optim, range(3, 6))


@pytest.mark.parametrize("sharded", [False, True])
def test_parameters_without_optimizer_state_stay_without(tmp_path, sharded):
    """A parameter never stepped before the save (unused so far) has no optimizer state
    after loading either: its first step then matches the uninterrupted run's."""
    path = str(tmp_path / "ckpt")
    if sharded:
        expected = run_distributed(_late_head_run, 2, path, True, False)[0]
        resumed = run_distributed(_late_head_run, 2, path, True, True)[0]
    else:
        expected, resumed = _late_head_run(path, False, False), _late_head_run(path, False, True)
    torch.testing.assert_close(resumed, expected, rtol=1e-5, atol=1e-6)


def _save_twice_dying(path: str, die: bool) -> None:
    model = make_model()
    fully_shard(model)
    optim = adamw(model)
    train(model, optim, range(1))
    ckpt.save(path, model, optim, extra={"step": 1})
    train(model, optim, range(1, 2))
    if die and dist.get_rank() == 1:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        def write_half_then_die(self, plan, planner):
            with open(os.path.join(str(self.path), "__1_0.distcp"), "wb") as f:
                f.write(b"\0" * 100)  # a partial file, then the rank is gone
            os._exit(1)

        FileSystemWriter.write_data = write_half_then_die
    ckpt.save(path, model, optim, extra={"step": 2})


def _load_step(path: str) -> tuple[object, float]:
    model = make_model(seed=5)
    fully_shard(model)
    optim = adamw(model)
    extra = ckpt.load(path, model, optim)
    return extra, train(model, optim, range(2, 3))[0]


def _step_two_after_one() -> float:
    model = make_model()
    fully_shard(model)
    optim = adamw(model)
    train(model, optim, range(1))
    return train(model, optim, range(2, 3))[0]


@pytest.mark.slow
def test_rank_killed_mid_save_leaves_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    with pytest.raises(RankFailure):
        run_distributed(_save_twice_dying, 2, path, True, timeout=60)
    versions = [n for n in os.listdir(path) if n.startswith("v")]
    assert len(versions) == 2  # the complete one and the broken one
    assert ckpt.exists(path) and ckpt.read_extra(path) == {"step": 1}  # without loading a tensor
    extra, loss = run_distributed(_load_step, 2, path)[0]
    assert extra == {"step": 1}  # LATEST still names the complete one
    # Reference: the same training without a checkpoint (step 1's state, then step 2's batch), exactly.
    assert loss == pytest.approx(run_distributed(_step_two_after_one, 2)[0], rel=1e-6)
    # A save that finishes removes the older version.
    clean = str(tmp_path / "clean")
    run_distributed(_save_twice_dying, 2, clean, False)
    os.remove(os.path.join(clean, "LATEST"))
    first = sorted(n for n in os.listdir(clean) if n.startswith("v"))
    assert len(first) == 1  # a finished save removes older versions


def _load(path: str, verify: bool = False) -> object:
    model = make_model()
    fully_shard(model)
    return ckpt.load(path, model, adamw(model), verify=verify)


def test_truncated_or_corrupt_file_is_named(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(_save_twice_dying, 2, path, False)
    with open(os.path.join(path, "LATEST")) as f:
        folder = os.path.join(path, f.read().strip())
    shard = os.path.join(folder, "__1_0.distcp")
    data = open(shard, "rb").read()
    with open(shard, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(RankFailure, match=r"CheckpointError: checkpoint .* is damaged: __1_0.distcp is truncated or altered"):
        run_distributed(_load, 2, path)
    with open(shard, "wb") as f:
        f.write(bytes(64) + data[64:])  # same size; the first record no longer unpickles
    with pytest.raises(RankFailure, match=r"__1_0.distcp is corrupt \(CRC-32 mismatch\)"):
        run_distributed(_load, 2, path)
    middle = len(data) // 2
    with open(shard, "wb") as f:
        f.write(data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1 :])  # one flipped bit
    assert run_distributed(_load, 2, path) == [{"step": 2}] * 2  # may go unnoticed by default...
    with pytest.raises(RankFailure, match=r"__1_0.distcp is corrupt \(CRC-32 mismatch\)"):
        run_distributed(_load, 2, path, True)  # ...but not with verify=True
    with open(shard, "wb") as f:
        f.write(data)
    assert run_distributed(_load, 2, path) == [{"step": 2}] * 2
    os.remove(os.path.join(path, "LATEST"))
    with pytest.raises(ckpt.CheckpointError, match="LATEST is missing"):
        ckpt.load(path, make_model(), None)
    assert not ckpt.exists(path) and not ckpt.exists(tmp_path / "nowhere")
    with pytest.raises(ckpt.CheckpointError, match="LATEST is missing"):
        ckpt.read_extra(path)
