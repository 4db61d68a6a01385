"""The world-2 GPU tests' bodies and their spawner (tests/gpu/gpu_ranks.py) dry-run on two CPU ranks
(gloo): the GPU machine then finds no broken rendezvous, pickling or reference in them. Their
values on CPU are checked as on GPU (the same assertions)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import gpu_ranks  # noqa: E402
import test_cuda  # noqa: E402
import test_cuda_kernels  # noqa: E402

# Two spawned processes that import torch: seconds each.
pytestmark = pytest.mark.launch
CPU = {"backend": "gloo", "device_type": "cpu", "timeout_s": 240.0}


def _every_world_2_body(mesh, path: str) -> None:
    """The bodies of the world-2 GPU tests in turn: one spawn of two processes serves them all
    (each spawn costs an import of torch per rank); a failure's traceback names its body."""
    test_cuda.check_matches_a_plain_model(mesh)
    test_cuda.check_state_dict_and_checkpoint_round_trip(mesh, path, False)
    test_cuda_kernels.check_bf16_training_equals_fsdp2(mesh)


def test_world_2_bodies_on_two_cpu_ranks(tmp_path):
    gpu_ranks.on_ranks(2, _every_world_2_body, str(tmp_path), **CPU)


def _raises_on_rank_1(mesh) -> None:
    if mesh.get_local_rank() == 1:
        raise ValueError("rank 1 raised on purpose")


def test_a_ranks_exception_reaches_the_test():
    with pytest.raises(Exception, match="rank 1 raised on purpose"):
        gpu_ranks.on_ranks(2, _raises_on_rank_1, **CPU)


def test_gpu_ranks_skip_with_the_reason_where_gpus_are_missing():
    with pytest.raises(pytest.skip.Exception, match="needs 64 CUDA GPUs"):
        gpu_ranks.on_ranks(64, _raises_on_rank_1)
