"""The multi-process harness: results, failures with rank and traceback, hangs, crashes;
and the one-process parity reference."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from fullshard.testing import DataParallelReference, RankFailure, RankTimeout, distributed, run_distributed
from fullshard.testing.harness import RankCrashed, RankCrashWarning, run_in_fresh_process, wait_for_groups_let_go


def _rank_and_sum():
    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_rank(), int(t.item())


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_in_rank_order(world_size):
    assert run_distributed(_rank_and_sum, world_size) == [(r, world_size) for r in range(world_size)]


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 waits on rank 1, which never arrives: gloo errors out


def test_failure_names_rank_and_traceback():
    with pytest.raises(RankFailure, match=r"(?s)^rank 1 of 2 failed in _fail_on_rank_one.*line \d+, in _fail_on_rank_one.*ValueError: boom on rank one"):
        run_distributed(_fail_on_rank_one, 2)
    assert run_distributed(_rank_and_sum, 2) == [(0, 2), (1, 2)]  # the pool survives


def _hang_on_rank_zero():
    if dist.get_rank() == 0:
        time.sleep(60)


@pytest.mark.slow  # kills the hung pool and starts a fresh one
def test_hang_is_reported_with_stacks():
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"(?s)did not finish within 3s on ranks \[0\].*_hang_on_rank_zero"):
        run_distributed(_hang_on_rank_zero, 2, timeout=3)
    assert time.monotonic() - start < 30
    assert run_distributed(_rank_and_sum, 2) == [(0, 2), (1, 2)]  # a fresh pool replaced it


def _crash_on_rank_one():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def test_crashed_rank_is_reported():
    with pytest.raises(RankFailure, match=r"died|failed"):
        run_distributed(_crash_on_rank_one, 2, timeout=60)
    assert run_distributed(_rank_and_sum, 2) == [(0, 2), (1, 2)]


def _return_a_tensor_that_requires_grad():
    return torch.ones(2, requires_grad=True) * 2  # cannot cross a process boundary


def test_unsendable_result_is_reported_at_once():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="could not send the result back.*detach"):
        run_distributed(_return_a_tensor_that_requires_grad, 2, timeout=60)
    assert time.monotonic() - start < 30
    assert run_distributed(_rank_and_sum, 2) == [(0, 2), (1, 2)]


def test_local_functions_are_rejected():
    def local():
        return 1

    with pytest.raises(ValueError, match="expects a module-level function"):
        run_distributed(local, 1)


@pytest.mark.parametrize("value", [3, 5])
@distributed(world_size=2)
def test_decorator_forwards_parameters(value):
    assert value in (3, 5) and dist.get_world_size() == 2
    assert torch.get_num_threads() == 1


def test_reference_casts_parameters_not_buffers():
    """Mixed precision casts parameters only: so must the one-process reference
    (a bf16 rotary ``inv_freq`` buffer made Llama's reference diverge)."""
    model = torch.nn.Linear(2, 2)
    model.register_buffer("scale", torch.ones(2))
    seen = []

    def loss_fn(module, batch):
        seen.append((module.weight.dtype, module.scale.dtype))
        return (module(batch[0].to(module.weight.dtype)) * module.scale).sum()

    DataParallelReference(model, loss_fn, torch.bfloat16).backward([(torch.ones(1, 2),)] * 2)
    assert seen == [(torch.bfloat16, torch.float32)] * 2
    assert model.weight.dtype == model.weight.grad.dtype == model.scale.dtype == torch.float32


def test_case_names_the_failing_row():
    from fullshard.testing import case

    with pytest.raises(ValueError) as raised:
        with case("'bad_row'"):
            raise ValueError("boom")
    assert raised.value.__notes__ == ["in case 'bad_row'"]


def _set_local_world_size() -> None:
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ.pop("FULLSHARD_TEST_HARNESS_KEPT", None)


def _read_environment() -> tuple[str | None, str | None]:
    return os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("FULLSHARD_TEST_HARNESS_KEPT")


def test_a_tasks_environment_changes_do_not_reach_the_next_task():
    """Pooled rank processes outlive a test: a variable a task sets (the hybrid tests' LOCAL_WORLD_SIZE)
    or removes is as it was before that task when the next one starts."""
    before = run_distributed(_read_environment, 2)
    run_distributed(_set_local_world_size, 2)
    assert run_distributed(_read_environment, 2) == before


def _op_on_a_subgroup_mesh() -> tuple[bool, bool, float]:
    """An op's output on a sub-mesh over a subgroup (a 2-D mesh's dim), and on the whole-world 1-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    sub = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))["shard"]
    out = distribute_tensor(torch.arange(8.0).reshape(4, 2), sub, [Shard(0)]) * 2
    world = init_device_mesh("cpu", (2,))
    world_out = distribute_tensor(torch.ones(4), world, [Shard(0)]) + 1
    return out.device_mesh is sub, world_out.device_mesh == world, out.full_tensor().sum().item()


def test_a_tasks_meshes_never_serve_the_next_task():
    """torch's DTensor caches key an op's output spec by mesh equality, which ignores the process groups:
    without the pool's per-task mesh keys the second task's output would sit on the first task's mesh,
    whose destroyed subgroups' names the second task reuses (for other ranks, in general)."""
    for _ in range(3):
        assert run_distributed(_op_on_a_subgroup_mesh, 2) == [(True, True, 56.0)] * 2


def _threads_of_this_rank() -> int:
    """Once the earlier tasks' groups are let go (the pool drops them on a thread of its own)."""
    wait_for_groups_let_go()
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_tasks_groups_end_their_threads_though_torch_caches_its_meshes():
    """torch caches each op's output spec with its mesh, and a mesh holds its groups (torch 2.13+): were
    those strong references, every task's destroyed subgroups would keep gloo's threads running (3 a
    group, each waking 100 times a second) until the caches are emptied."""
    before = run_distributed(_threads_of_this_rank, 2)
    for _ in range(5):
        run_distributed(_op_on_a_subgroup_mesh, 2)
    after = run_distributed(_threads_of_this_rank, 2)
    growth = [a - b for a, b in zip(after, before)]
    assert max(growth) < 3, f"threads per rank before {before}, after five tasks {after}"


@distributed(world_size=2)
def _dies_by_a_signal_the_first_time(marker: str) -> int:
    if dist.get_rank() == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()
    return dist.get_rank()


def test_rank_killed_by_a_signal_is_named_and_the_test_runs_again(tmp_path):
    """The first run's rank 1 dies by SIGSEGV: the warning names the signal and carries the
    rank's native stacks (faulthandler); the second run, on fresh ranks, passes."""
    with pytest.warns(RankCrashWarning) as record:
        _dies_by_a_signal_the_first_time(str(tmp_path / "crashed-once"))
    text = str(record[0].message)
    assert "rank 1: killed by SIGSEGV" in text
    assert "Fatal Python error: Segmentation fault" in text and "_dies_by_a_signal_the_first_time" in text


def _pid_and_sum(a: int, b: int) -> tuple[int, int]:
    return os.getpid(), a + b


def _raise_in_fresh_process() -> None:
    raise ValueError("raised on purpose")


def _die_in_fresh_process() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_fresh_process_returns_raises_and_dies_by_name():
    pid, total = run_in_fresh_process(_pid_and_sum, 2, 3)
    assert total == 5 and pid != os.getpid()
    with pytest.raises(RankFailure, match=r"(?s)_raise_in_fresh_process failed.*ValueError: raised on purpose"):
        run_in_fresh_process(_raise_in_fresh_process)
    start = time.monotonic()
    with pytest.raises(RankCrashed, match="_die_in_fresh_process in a fresh process: killed by SIGKILL"):
        run_in_fresh_process(_die_in_fresh_process, timeout=60)
    assert time.monotonic() - start < 10  # noticed at once, not at the timeout
