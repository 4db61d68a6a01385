"""Run a function on N ranks (gloo, CPU, 127.0.0.1) from a pytest process.

[Note: Rank pool]
Starting a Python process that imports torch costs seconds; a test suite that
spawned fresh ranks per test would spend most of its time there. A ``RankPool``
keeps ``world_size`` worker processes alive for the whole session. The workers
are forked from one server process that imported torch and this package once
(multiprocessing's ``forkserver``, see ``rank_process_context``): a pool, or a
fresh one replacing a crashed pool, starts in a fraction of a second instead of
an import of torch per rank, and the forks share the server's memory pages. Each task
gets a fresh default process group (rendezvous through a ``PrefixStore`` over
one ``TCPStore`` hosted here), runs, and destroys every group it made, so tests
do not leak groups or debug settings into each other.

The ranks run gloo on CPU, also on a machine with a GPU: each worker hides
CUDA from itself before torch first looks (``CUDA_VISIBLE_DEVICES=""``), so
every default that picks "the accelerator if there is one" (the default mesh,
the wrapper's device, ``fullshard train``'s backend) picks CPU, the device
the tests' inputs and oracles are on. GPU tests live in tests/gpu/.

A rank that raises sends its traceback back; the pool re-raises it here naming
the rank. A task that does not finish within its timeout is reported with the
stacks of every rank (``faulthandler``), and the pool is killed and replaced.
A rank that dies is reported with how it died (exit code or signal) and the end
of its log, where ``faulthandler`` leaves the Python stacks of a native crash.
A ``@distributed`` test whose rank is killed by a signal runs once more on fresh
ranks, with a ``RankCrashWarning`` that carries the crash: a long-lived rank
holds the state of every earlier task, so a rare native crash there (seen once
in CI, never reproduced) must not fail an unrelated test silently or pass
silently either.

torch's DTensor caches live as long as a worker: a spec propagated in one task
serves every later task whose operator signature, shapes and mesh are equal, so
a test pays the propagation (about 20 ms an operator signature) only for what
earlier tests did not run. Mesh equality ignores the process groups; a task's
meshes on subgroups therefore carry its id as their world key, and hold their
groups weakly, so that a destroyed group's gloo threads end with the task
(``_keep_task_meshes_apart``).
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import functools
import gc
import importlib
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 120.0
# A rank blocked in a collective whose peer already failed errors out once gloo
# notices the closed connection; this bounds how long we wait for that.
_GRACE_AFTER_FAILURE_S = 15.0


class RankFailure(AssertionError):
    """A rank raised: the message carries the rank and its traceback."""


class RankCrashed(RankFailure):
    """A rank process was killed by a signal (a native crash, or killed from outside)."""


class RankCrashWarning(UserWarning):
    """A ``@distributed`` test's rank crashed natively and the test was run again on a fresh pool."""


class RankTimeout(AssertionError):
    """Ranks did not finish in time: the message carries every rank's stack."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class _Task:
    task_id: int
    module: str
    qualname: str
    sys_path: list[str]
    args: tuple
    kwargs: dict
    pg_timeout_s: float


def _resolve(module: str, qualname: str) -> Callable:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    # `@distributed` tests carry the per-rank body under this attribute.
    return getattr(obj, "__rank_fn__", obj)


def _run_task(rank: int, world_size: int, store: Any, task: _Task) -> tuple[bool, Any, float]:
    """Returns (ok, value or traceback text, time of failure)."""
    import torch
    import torch.distributed as dist

    _current_task[0] = task.task_id  # the world key of this task's meshes (_keep_task_meshes_apart)
    sys.path[:] = task.sys_path
    environ = dict(os.environ)  # restored after the task: a test's LOCAL_WORLD_SIZE must not reach the next
    try:
        prefix_store = dist.PrefixStore(f"task{task.task_id}/", store)
        dist.init_process_group(
            "gloo",
            store=prefix_store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=task.pg_timeout_s),
        )
        torch.manual_seed(0)
        return True, _resolve(task.module, task.qualname)(*task.args, **task.kwargs), 0.0
    except BaseException as exc:  # noqa: BLE001 - everything goes back to pytest
        # Stamp the failure before tearing down the group: peers blocked in a
        # collective fail only after that, so the earliest stamp is the cause.
        return False, "".join(traceback.format_exception(exc)), time.time()
    finally:
        _collect_task_garbage()
        if dist.is_initialized():
            _destroy_groups_without_waiting()
        dist.set_debug_level(dist.DebugLevel.OFF)
        os.environ.clear()
        os.environ.update(environ)
        os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)


def _collect_task_garbage() -> None:
    """Frees the task's models (reference cycles) while their process groups are still valid,
    so that destroying the groups ends gloo's threads now, not at some later collection (a
    rank's thread count once reached 960). Objects older than the last task are frozen
    (``gc.freeze``): the collection walks only what this task made, about a millisecond."""
    gc.collect()
    gc.freeze()


# The name of the threads that drop a task's destroyed groups (see _destroy_groups_without_waiting).
_LETTING_GROUPS_GO = "fullshard-let-groups-go"


def _destroy_groups_without_waiting() -> None:
    """Destroys every group the task made, and lets them go on a thread of their own: a gloo
    group's last reference joins its threads, which notice only at their next 10 ms poll (about
    20 ms a group, measured; the GIL is free meanwhile), so the next task starts at once."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    groups = list(distributed_c10d._world.pg_map)
    dist.destroy_process_group()
    threading.Thread(target=groups.clear, name=_LETTING_GROUPS_GO, daemon=True).start()


def wait_for_groups_let_go() -> None:
    """Returns once the groups of the tasks before this one have ended (their threads too)."""
    for thread in threading.enumerate():
        if thread.name == _LETTING_GROUPS_GO:
            thread.join()


# The task running now; see _keep_task_meshes_apart.
_current_task = [0]


def _keep_task_meshes_apart() -> None:
    """Gives every mesh a task makes on other groups than the default one the task's id as its
    world key. torch's DTensor caches key a spec by its mesh, and mesh equality ignores the
    process groups: a later task's equal mesh would get output specs on this task's destroyed
    subgroups, whose names the next task reuses for other groups (of other ranks, or none:
    "Could not resolve the process group registered under the name ..."), which torch's own
    tests, one process each, never meet. torch keeps the worlds of its threaded test harness
    apart the same way: a mesh's ``_thread_id`` is part of its equality and hash. Meshes on the
    default group alone stay shared across tasks: its name resolves to each task's default
    group, the same ranks, so their cached specs (about 0.7 s to refill per DTensor optimizer
    test) stay valid. A mesh whose groups are not known when it is made (a sub-mesh on older
    torch) gets the key too.

    A mesh also holds its groups (``_pg_registry``, torch 2.13+; read only while compiling,
    when the groups are alive), so a cached spec would keep every destroyed group of every
    task, and its gloo threads, which wake 100 times a second each: 50 such groups cost a rank
    8% of a core while it waits. Held weakly, a group ends when the task destroys it."""
    from torch.distributed.device_mesh import DeviceMesh

    make = DeviceMesh.__init__

    @functools.wraps(make)
    def make_keyed(self: DeviceMesh, *args: Any, **kwargs: Any) -> None:  # "self": torch passes mesh=...
        make(self, *args, **kwargs)
        if self._thread_id is None and list(getattr(self, "_dim_group_names", None) or ()) != ["0"]:
            self._thread_id = _current_task[0]
        registry = getattr(self, "_pg_registry", None)
        if type(registry) is dict:  # torch 2.13+: see the docstring
            self._pg_registry = weakref.WeakValueDictionary(registry)  # type: ignore[assignment]

    DeviceMesh.__init__ = make_keyed  # type: ignore[method-assign]


def rank_process_context() -> Any:
    """The multiprocessing context that starts rank processes: forks of a server that imported
    this module (and with it torch) once, with CUDA hidden (see [Note: Rank pool]). The server
    starts with the first process and serves every later one, pools and fresh pairs alike."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the server's environment, which its forks inherit
    try:
        from multiprocessing import forkserver

        forkserver.ensure_running()
    finally:
        if hidden is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden
    return ctx


def _worker_main(rank: int, world_size: int, port: int, tasks: Any, results: Any, log_path: str) -> None:
    # The modules the server imported live as long as this process: the collector need not walk them.
    gc.freeze()
    log = open(log_path, "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    faulthandler.enable(file=log, all_threads=True)  # a native crash leaves its Python stacks in the log
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks: see [Note: Rank pool]

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N ranks share a few cores: do not oversubscribe
    _seed_the_cpu_only()
    _keep_task_meshes_apart()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    while True:
        task = tasks.get()
        if task is None:
            wait_for_groups_let_go()  # not at exit, in the middle of a group's destructor
            return
        print(f"=== task {task.task_id}: {task.module}.{task.qualname}", flush=True)
        ok, value, failed_at = _run_task(rank, world_size, store, task)
        if not ok:
            print(value, flush=True)
        try:
            # The queue pickles in a background thread, where a failure would be
            # lost and the test would time out: pickle here first.
            ForkingPickler.dumps(value)
        except Exception as exc:  # noqa: BLE001 - e.g. a tensor that requires grad
            ok, value, failed_at = False, f"could not send the result back: {exc!r}", time.time()
        results.put((task.task_id, rank, ok, value, failed_at))


def _seed_the_cpu_only() -> None:
    """``torch.manual_seed`` also seeds CUDA, XPU and MTIA; where those are not initialized (here
    never: CUDA is hidden) each queues the seed with the caller's formatted stack, which reads and
    stats every source file on it: about 3 ms a call from a test's deep stack, 7,000 calls in the
    conformance matrix alone. A rank here has the CPU generator only, so those calls are dropped."""
    import torch

    torch.cuda.manual_seed_all = _no_device_to_seed
    torch.xpu.manual_seed_all = _no_device_to_seed
    torch.mtia.manual_seed_all = _no_device_to_seed


def _no_device_to_seed(seed: int) -> None:
    """A rank's hidden or absent accelerator: nothing to seed (see ``_seed_the_cpu_only``)."""


def _describe_exit(exitcode: int | None) -> str:
    """A process's exit code in words: a negative code is the signal that killed it."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class RankPool:
    """``world_size`` long-lived rank processes. See [Note: Rank pool]."""

    def __init__(self, world_size: int) -> None:
        import torch.distributed as dist

        self.world_size = world_size
        self._next_task_id = 0
        port = free_port()
        self._store = dist.TCPStore(
            "127.0.0.1",
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=60),
        )
        ctx = rank_process_context()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._log_dir = tempfile.mkdtemp(prefix=f"fullshard-ranks{world_size}-")
        self._procs = []
        for rank in range(world_size):
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, world_size, port, self._tasks[rank], self._results, self.log_path(rank)),
                daemon=True,
            )
            proc.start()
            self._procs.append(proc)

    def log_path(self, rank: int) -> str:
        return os.path.join(self._log_dir, f"rank{rank}.log")

    def is_healthy(self) -> bool:
        return bool(self._procs) and all(proc.is_alive() for proc in self._procs)

    def run(
        self,
        fn: Callable,
        args: tuple = (),
        kwargs: dict | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> list[Any]:
        """Runs ``fn(*args, **kwargs)`` on every rank; returns the per-rank results."""
        if "<locals>" in fn.__qualname__ or fn.__name__ == "<lambda>":
            raise ValueError(
                f"run_distributed expects a module-level function but got {fn.__qualname__}: "
                "rank processes import it by name"
            )
        self._next_task_id += 1
        task = _Task(
            self._next_task_id,
            fn.__module__,
            fn.__qualname__,
            list(sys.path),
            tuple(args),
            dict(kwargs or {}),
            pg_timeout_s=max(30.0, timeout / 2),
        )
        for task_queue in self._tasks:
            task_queue.put(task)
        return self._collect(task, timeout)

    def _collect(self, task: _Task, timeout: float) -> list[Any]:
        values: dict[int, Any] = {}
        failures: dict[int, tuple[float, str]] = {}
        deadline = time.monotonic() + timeout
        while len(values) + len(failures) < self.world_size:
            now = time.monotonic()
            if failures:
                deadline = min(deadline, now + _GRACE_AFTER_FAILURE_S)
            if now >= deadline:
                break
            try:
                task_id, rank, ok, value, failed_at = self._results.get(timeout=min(1.0, deadline - now))
            except queue.Empty:
                dead = [rank for rank, proc in enumerate(self._procs) if not proc.is_alive()]
                if dead:
                    exitcodes = [self._procs[r].exitcode for r in dead]
                    codes = ", ".join(f"rank {r}: {_describe_exit(code)}" for r, code in zip(dead, exitcodes))
                    tails = self._log_tails(dead)  # before close(), which removes the logs
                    self.close()
                    signalled = any(code is not None and code < 0 for code in exitcodes)
                    raise (RankCrashed if signalled else RankFailure)(
                        f"rank(s) {dead} died while running {task.qualname} ({codes})\n" + tails
                    ) from None
                continue
            if task_id != task.task_id:
                continue  # a late answer from an earlier task that was given up on
            if ok:
                values[rank] = value
            else:
                failures[rank] = (failed_at, value)
        if failures:
            missing = sorted(set(range(self.world_size)) - set(values) - set(failures))
            if missing:
                self.close()  # those ranks are stuck; this pool cannot be trusted again
            first = min(failures, key=lambda r: failures[r][0])
            others = ", ".join(str(r) for r in sorted(failures) if r != first)
            raise RankFailure(
                f"rank {first} of {self.world_size} failed in {task.qualname}"
                + (f" (ranks {others} failed too)" if others else "")
                + (f" (ranks {missing} never finished)" if missing else "")
                + f":\n{failures[first][1]}"
            )
        if len(values) < self.world_size:
            missing = sorted(set(range(self.world_size)) - set(values))
            stacks = self._dump_stacks(missing)
            self.close()
            raise RankTimeout(
                f"{task.qualname} did not finish within {timeout:.0f}s on ranks {missing} "
                f"of {self.world_size} (a hang?). Their stacks:\n{stacks}"
            )
        return [values[rank] for rank in range(self.world_size)]

    def _dump_stacks(self, ranks: list[int]) -> str:
        for rank in ranks:
            pid = self._procs[rank].pid  # None only before start()
            if pid is not None and self._procs[rank].is_alive():
                os.kill(pid, signal.SIGUSR1)
        time.sleep(1.0)
        return self._log_tails(ranks, num_chars=6000)

    def _log_tails(self, ranks: list[int], num_chars: int = 4000) -> str:
        parts = []
        for rank in ranks:
            try:
                with open(self.log_path(rank)) as f:
                    text = f.read()
            except OSError:
                text = "<no log>"
            parts.append(f"--- rank {rank}'s log ---\n{text[-num_chars:]}")
        return "\n".join(parts)

    def close(self) -> None:
        for task_queue, proc in zip(self._tasks, self._procs):
            if proc.is_alive():
                try:
                    task_queue.put(None)
                except (OSError, ValueError):
                    pass
        for proc in self._procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2)
        self._procs = []
        shutil.rmtree(self._log_dir, ignore_errors=True)  # the ranks' logs: failures quoted them already


_pools: dict[int, RankPool] = {}
atexit.register(lambda: close_pools())


def get_pool(world_size: int) -> RankPool:
    pool = _pools.get(world_size)
    if pool is None or not pool.is_healthy():
        if pool is not None:
            pool.close()
        pool = _pools[world_size] = RankPool(world_size)
    return pool


def close_pools() -> None:
    for pool in _pools.values():
        pool.close()
    _pools.clear()


def run_distributed(
    fn: Callable, world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any
) -> list[Any]:
    """Runs the module-level function ``fn`` on ``world_size`` gloo ranks.

    Returns each rank's return value (rank order). Raises ``RankFailure`` with
    the failing rank's traceback, or ``RankTimeout`` with every rank's stack.
    """
    if world_size < 1:
        raise ValueError(f"run_distributed expects world_size >= 1 but got {world_size}")
    return get_pool(world_size).run(fn, args, kwargs, timeout)


def run_in_fresh_process(fn: Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT_S) -> Any:
    """Returns ``fn(*args)`` run in a process forked from the rank server: torch imported, nothing
    run yet, as in a user's process (a pool's ranks keep torch's caches from earlier tasks). The
    fork costs a fraction of a second where a fresh interpreter imports torch for seconds."""
    ctx = rank_process_context()
    results = ctx.Queue()
    proc = ctx.Process(target=_run_fresh, args=(fn.__module__, fn.__qualname__, list(sys.path), args, results))
    proc.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                ok, value = results.get(timeout=1)
                break
            except queue.Empty:
                if proc.exitcode is not None and results.empty():  # it died without an answer
                    raise RankCrashed(
                        f"{fn.__qualname__} in a fresh process: {_describe_exit(proc.exitcode)}"
                    ) from None
                if time.monotonic() > deadline:
                    raise RankTimeout(
                        f"{fn.__qualname__} did not finish within {timeout:.0f}s in a fresh process"
                    ) from None
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    if not ok:
        raise RankFailure(f"{fn.__qualname__} failed in a fresh process:\n{value}")
    return value


def _run_fresh(module: str, qualname: str, sys_path: list[str], args: tuple, results: Any) -> None:
    sys.path[:] = sys_path
    try:
        results.put((True, _resolve(module, qualname)(*args)))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller
        results.put((False, "".join(traceback.format_exception(exc))))


def distributed(world_size: int = 2, timeout: float = DEFAULT_TIMEOUT_S) -> Callable:
    """Decorates a test so that its body runs on ``world_size`` ranks.

    The decorated function is what pytest calls (in the pytest process); it
    ships the undecorated body, with pytest's parameters as keyword arguments,
    to the rank pool. Example::

        @distributed(world_size=2)
        def test_allreduce():
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == dist.get_world_size()
    """

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def test(*args: Any, **kwargs: Any) -> None:
            try:
                get_pool(world_size).run(test, args, kwargs, timeout)
            except RankCrashed as crash:
                # A rank that dies by a signal takes ~100 earlier tasks' process state with it; the
                # test runs again once on fresh ranks, and the crash (with the dead rank's native
                # stacks, see faulthandler in _worker_main) is reported as a warning, never hidden.
                warnings.warn(
                    f"{fn.__qualname__}: a rank crashed; ran again on fresh ranks:\n{crash}",
                    RankCrashWarning,
                    stacklevel=2,
                )
                get_pool(world_size).run(test, args, kwargs, timeout)

        test.__rank_fn__ = fn  # type: ignore[attr-defined]
        return test

    return decorate
