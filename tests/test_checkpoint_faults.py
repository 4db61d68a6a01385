"""Checkpoints that cannot lie (issue 36): a full disk mid-save, a missing rank's file, a
checkpoint of another model. Each gets an error naming the file or the parameter, and the
previous complete checkpoint stays the one ``load`` finds."""

import errno
import os

import pytest
import torch
import torch.distributed as dist

from fullshard import checkpoint as ckpt
from fullshard import fully_shard
from fullshard.models import ModelArgs, Transformer
from fullshard.testing import RankFailure, run_distributed

# Out of the inner loop: test_checkpoint.py::test_truncated_or_corrupt_file_is_named takes the load's checks there.
pytestmark = pytest.mark.slow

ARGS = ModelArgs(n_layers=2, vocab_size=32, max_seq_len=8, dim=16)


def _sharded(args: ModelArgs = ARGS) -> tuple[Transformer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Transformer(args)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(args.vocab_size, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(tokens).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _first_values(model: torch.nn.Module) -> list[float]:
    return [p.to_local().flatten()[:1].tolist() for p in model.parameters()]


def _save_then_fill_the_disk(path: str) -> tuple[list, str]:
    """Saves once, then again with rank 1's disk full: its first write fails."""
    model, optim = _sharded()
    ckpt.save(path, model, optim, extra={"step": 1})
    saved = _first_values(model)
    if dist.get_rank() == 1:
        original = ckpt._ChecksummedStream.write

        def full_disk(self, data):  # noqa: ANN001 - the stream's own signature
            raise OSError(errno.ENOSPC, "No space left on device")

        ckpt._ChecksummedStream.write = full_disk
    try:
        ckpt.save(path, model, optim, extra={"step": 2})
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return saved, f"{type(exc).__name__}: {exc}"
    finally:
        if dist.get_rank() == 1:
            ckpt._ChecksummedStream.write = original
    return saved, ""


def _load_values(path: str) -> tuple[object, list]:
    model, optim = _sharded()
    extra = ckpt.load(path, model, optim, verify=True)
    return extra, _first_values(model)


def test_a_full_disk_mid_save_names_the_rank_and_keeps_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    results = run_distributed(_save_then_fill_the_disk, 2, path)
    for rank, (_, message) in enumerate(results):
        assert message.startswith("CheckpointError"), f"rank {rank}: {message[:500]}"
        assert "No space left on device" in message and "rank 1" in message, message[:800]
        assert "(writing " in message and ".distcp)" in message, message[:800]  # the file it was writing
    assert ckpt.read_extra(path) == {"step": 1}
    loaded = run_distributed(_load_values, 2, path)
    for rank, (extra, values) in enumerate(loaded):
        assert extra == {"step": 1}
        assert values == results[rank][0]  # the values of the first save, on every rank


def test_a_missing_rank_file_is_named(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(_save_then_fill_the_disk, 2, path)  # one complete checkpoint, one broken folder
    with open(os.path.join(path, "LATEST")) as f:
        folder = os.path.join(path, f.read().strip())
    os.remove(os.path.join(folder, "__1_0.distcp"))
    with pytest.raises(RankFailure, match=r"CheckpointError: checkpoint .* is damaged: __1_0.distcp is missing"):
        run_distributed(_load_values, 2, path)


def _save(path: str) -> None:
    model, optim = _sharded()
    ckpt.save(path, model, optim)


def _load_into_another_model(path: str) -> None:
    model, optim = _sharded(ModelArgs(n_layers=2, vocab_size=48, max_seq_len=8, dim=16))
    ckpt.load(path, model, optim)


def test_a_checkpoint_of_another_model_names_the_parameter(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(_save, 2, path)
    with pytest.raises(RankFailure) as failure:
        run_distributed(_load_into_another_model, 2, path)
    message = str(failure.value)
    assert "CheckpointError" in message and "does not fit this model" in message
    assert "tok_embeddings.weight" in message
