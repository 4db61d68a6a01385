"""``fullshard train``: train a GPT preset on the embedded corpus over N ranks, launched by torchrun.

    fullshard train                                       # gpt-tiny, 2 ranks, FULL_SHARD, 200 steps
    fullshard train --nproc 4 --strategy hybrid --shard-size 2 --mixed-precision bf16
    fullshard train --steps 1000 --checkpoint-dir ckpt    # Ctrl-C saves; then add --resume to go on
    fullshard train --model gpt-30m --nproc 2 --batch 8 --metrics run.jsonl --sample 200
    # two machines (run on each, node rank 0 and 1):
    fullshard train --nnodes 2 --node-rank 0 --nproc 8 --master-addr host0 --master-port 29500
    # elastic, 1 to 2 machines (the same line on each): a lost machine's job goes on, smaller,
    # from the newest checkpoint (the folder shared by the machines)
    fullshard train --nnodes 1:2 --nproc 8 --rdzv-backend c10d --rdzv-endpoint host0:29400 --rdzv-id job7 \\
        --max-restarts 3 --checkpoint-dir /shared/ckpt --checkpoint-every 50

The ranks are started by torchrun's own launcher (``torch.distributed.run``):
NCCL with one GPU per rank where this machine has a GPU for every rank, else
gloo on the CPU (``--device`` chooses; a machine with too few GPUs for
``--nproc`` says so and trains on the CPU, or names the fix under
``--device cuda``). Rank 0 shows a progress bar (loss, tokens/s, each rank's
peak memory) and ends with a summary table; ``--metrics`` also writes JSON
lines. The model is built on the meta device and initialised shard by shard,
with values that do not depend on the world size: the same seed gives the same
loss curve on any number of ranks (up to float rounding), and ``--resume``
continues it exactly, at any world size or strategy.

Ctrl-C stops every rank after the same step and saves a checkpoint (with
``--checkpoint-dir``); a second Ctrl-C, or a rank that dies, stops the others
at once (a rank that is saving finishes the save first), the launcher removes
what a cut save left, and the newest complete checkpoint stays loadable.

Every problem with the flags is reported before any rank starts, all at once,
one ``fullshard train: <flag> <value>: ...`` line each (exit code 2); flags that
do nothing in a combination are warned, and the summary labels what ran.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Iterator

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import parse_args as parse_torchrun_args
from torch.distributed.run import run as torchrun

from .._text import human_bytes
from ..training.config import TrainConfig
from ..training.config import add_arguments as add_training_arguments
from ..training.loop import learning_rate
from ..training.resume import checkpoint_problems, remove_unfinished_saves, saved_step
from ..training.summary import predict
from . import train_auto
from .flags import only_with, set_flags
from .paths import file_problems, folder_problems

HELP = "train a GPT on the embedded corpus over N ranks (progress, summary, checkpoints)"

__all__ = ["HELP", "add_arguments", "check", "node_range", "problems", "run", "torchrun_arguments"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    launch = parser.add_argument_group("launch (torchrun's options, passed through)")
    launch.add_argument(
        "--nproc", "--nproc-per-node", dest="nproc", type=int, default=2, help="ranks on this machine (default 2)"
    )
    launch.add_argument(
        "--device",
        choices=["auto", "cuda", "cpu"],
        default="auto",
        help="where the ranks compute: cuda (NCCL, a GPU per rank), cpu (gloo), or auto (default): "
        "cuda when this machine has a GPU for every rank, else cpu",
    )
    launch.add_argument("--nnodes", default="1", help="machines, or MIN:MAX for an elastic job")
    launch.add_argument("--node-rank", type=int, default=0, help="this machine's index (static rendezvous)")
    launch.add_argument("--master-addr", help="rank 0's machine (static rendezvous)")
    launch.add_argument("--master-port", type=int, help="a free port on that machine")
    launch.add_argument("--rdzv-backend", help="rendezvous backend, e.g. c10d")
    launch.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous")
    launch.add_argument("--rdzv-id", help="a job id shared by all machines")
    launch.add_argument(
        "--rdzv-conf",
        help="rendezvous settings, KEY=VALUE,... (e.g. last_call_timeout=5: how long an elastic job waits "
        "for more machines once MIN have joined)",
    )
    launch.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="when a rank fails, restart every rank up to N times (torchrun's elastic agent); each restart "
        "resumes from the newest complete checkpoint in --checkpoint-dir, on as many machines as are left "
        "within --nnodes MIN:MAX (default 0: a failure ends the run)",
    )
    add_training_arguments(parser)
    train_auto.add_arguments(parser)


def torchrun_arguments(args: argparse.Namespace, config: TrainConfig) -> list[str]:
    """torchrun's command line: the launch options, then this package's rank program and the config."""
    options = ["--nproc-per-node", str(args.nproc), "--nnodes", args.nnodes, "--node-rank", str(args.node_rank)]
    options += ["--max-restarts", str(args.max_restarts)]
    for flag in ("master_addr", "master_port", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf"):
        value = getattr(args, flag)
        if value is not None:
            options += ["--" + flag.replace("_", "-"), str(value)]
    return [*options, "--module", "fullshard.training", config.to_json()]


def choose_device(requested: str, nproc: int, gpus: int) -> tuple[str, str | None]:
    """Where ``nproc`` ranks on this machine compute, given its ``gpus``, and a line
    for the user when ``auto`` passes GPUs by (NCCL needs one GPU per rank)."""
    if requested == "cpu" or (requested == "auto" and gpus == 0):
        return "cpu", None
    if gpus >= nproc:
        return "cuda", None
    plural = "s" if gpus != 1 else ""
    if requested == "cuda":
        if gpus == 0:
            raise ValueError("--device cuda needs a GPU per rank, but this process sees no GPU: use --device cpu")
        raise ValueError(
            f"--device cuda needs a GPU per rank, but --nproc {nproc} asks for {nproc} ranks and this machine "
            f"has {gpus} GPU{plural}: use --nproc {gpus}, or --device cpu"
        )
    return "cpu", (
        f"fullshard train: {nproc} ranks but {gpus} GPU{plural} on this machine: training on "
        f"the CPU with gloo (--nproc {gpus} trains on the GPU{plural})"
    )


@contextlib.contextmanager
def _ranks_see(device: str) -> Iterator[None]:
    """The ranks torchrun starts inherit this environment: on ``cpu`` they see no GPU,
    so they choose gloo and compute on the CPU."""
    if device == "cuda":
        yield
        return
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def check(args: argparse.Namespace) -> tuple[TrainConfig | None, list[str], list[str]]:
    """Every problem with the flags at once: (the config, errors, notices), one line each."""
    names = {field.name for field in dataclasses.fields(TrainConfig)}
    config = TrainConfig(**{name: value for name, value in vars(args).items() if name in names})
    errors = config.problems()
    notices: list[str] = []
    nodes, node_errors = node_range(args)
    errors += node_errors
    if args.nproc < 1:
        errors.append(f"--nproc expects at least 1 rank but got {args.nproc}")
    elif nodes:
        for count in nodes:  # an elastic job may run at any of these sizes
            errors += [line for line in config.world_problems(count * args.nproc, args.nproc) if line not in errors]
        if nodes == range(1, 2):
            notices += _no_effect(config, args.nproc)
    if args.max_restarts < 0:
        errors.append(f"--max-restarts expects a number >= 0 but got {args.max_restarts}")
    elif args.max_restarts > 0 and not config.checkpoint_dir:
        errors.append(
            f"--max-restarts {args.max_restarts} needs --checkpoint-dir (with --checkpoint-every): a restart "
            "resumes from the newest checkpoint there"
        )
    errors += _launch_problems(args, nodes) + _idle_flags(args, config)
    notices += _schedule_notices(args, config)
    if config.metrics:
        errors += file_problems("--metrics", config.metrics)
    if config.checkpoint_dir:
        errors += folder_problems("--checkpoint-dir", config.checkpoint_dir)
    if errors:  # the checkpoint's checks need a valid model and folder
        return None, errors, notices
    found, said = checkpoint_problems(config)
    return (None if found else config), errors + found, notices + said


def _launch_problems(args: argparse.Namespace, nodes: range) -> list[str]:
    """torchrun's options that no launch could use: a node rank past the machines, static-rendezvous
    options under another rendezvous (torchrun ignores them there)."""
    found = []
    if nodes and not 0 <= args.node_rank < nodes.stop - 1:
        found.append(f"--node-rank {args.node_rank} must be at least 0 and below --nnodes {args.nnodes}")
    static_only = set_flags(args, ["node_rank", "master_addr", "master_port"])
    if static_only and args.rdzv_backend not in (None, "static"):
        found.append(
            only_with(
                static_only,
                f"to the static rendezvous, not to --rdzv-backend {args.rdzv_backend} (which numbers the machines "
                "and finds rank 0 at --rdzv-endpoint)",
                "drop --rdzv-backend",
            )
        )
    return found


def _idle_flags(args: argparse.Namespace, config: TrainConfig) -> list[str]:
    """Flags that would do nothing in this combination: errors, so that none is silently ignored."""
    found = []
    auto_only = set_flags(args, ["memory_limit", "profile"])
    if auto_only and not args.auto:
        found.append(only_with(auto_only, "to --auto (the plan's search)", "add --auto"))
    chosen = set_flags(args, ["strategy", "shard_size", "mixed_precision", "cpu_offload", "all_gather_dtype"])
    if chosen and args.auto:
        found.append(only_with(chosen, "without --auto (which chooses them)", "drop --auto"))
    every = set_flags(args, ["checkpoint_every"])
    if every and not config.checkpoint_dir:
        found.append(only_with(every, "with --checkpoint-dir (where the checkpoints go)", "add --checkpoint-dir DIR"))
    return found


def _schedule_notices(args: argparse.Namespace, config: TrainConfig) -> list[str]:
    """A warm-up as long as the run: --lr is never reached."""
    if 0 < config.steps <= config.warmup and config.lr > 0:
        default = "" if set_flags(args, ["warmup"]) else " (the default)"
        return [
            f"warning: --warmup {config.warmup}{default} is not below --steps {config.steps}: the learning rate "
            f"rises for the whole run and ends at {learning_rate(config, config.steps - 1):.3g}, below --lr "
            f"{config.lr:g}"
        ]
    return []


def node_range(args: argparse.Namespace) -> tuple[range, list[str]]:
    """The machine counts ``--nnodes`` (N or MIN:MAX) allows, and what is wrong with it."""
    text = args.nnodes
    try:
        low, _, high = text.partition(":")
        nodes = range(int(low), int(high or low) + 1)
    except ValueError:
        return range(0), [f"--nnodes expects N or MIN:MAX (machine counts) but got {text!r}"]
    if not 0 < nodes.start < nodes.stop:
        return range(0), [f"--nnodes expects 0 < MIN <= MAX but got {text!r}"]
    if len(nodes) > 1 and args.rdzv_backend in (None, "static"):
        return nodes, [
            f"--nnodes {text} (elastic: the job goes on with as few as {nodes.start} machines) needs "
            "--rdzv-backend c10d and --rdzv-endpoint HOST:PORT; the static rendezvous waits for a fixed number"
        ]
    return nodes, []


def problems(args: argparse.Namespace) -> list[str]:
    """Every invalid flag, one line each (``check``'s errors)."""
    return check(args)[1]


def _no_effect(config: TrainConfig, world_size: int) -> list[str]:
    """Warnings for flags that do nothing in this combination on one machine."""
    shard = config.shard_group_size(world_size, world_size)
    said = []
    if world_size == 1 and config.strategy != "full":
        said.append(
            f"warning: --strategy {config.strategy} has no effect with one rank: there is nothing to shard or "
            "replicate (every strategy is the same)"
        )
    if config.strategy == "hybrid" and world_size > 1 and shard in (1, world_size):
        what = "full sharding (no replicas, no all-reduce)" if shard > 1 else "replication (no sharding)"
        said.append(
            f"warning: --strategy hybrid with shard groups of {shard} over --nproc {world_size} is {what}: "
            f"it is labelled so; for replicas of shard groups pass a --shard-size that divides {world_size} "
            f"and is neither 1 nor {world_size}"
        )
    if config.all_gather_dtype != "none" and shard == 1:
        said.append(
            f"warning: --all-gather-dtype {config.all_gather_dtype} has no effect here: with one rank per shard "
            "group no all-gather runs (the weights stay exact)"
        )
    return said


@contextlib.contextmanager
def _quiet_launcher(quiet: bool) -> Iterator[None]:
    """A failure or a Ctrl-C is described once, below; torchrun's log lines would repeat it (``--debug``
    keeps them). torchrun gives each of its modules' loggers a level of its own, so each is raised."""
    prefix = "torch.distributed.elastic"
    names = [prefix] + [name for name in logging.root.manager.loggerDict if name.startswith(prefix + ".")]
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    if quiet:
        for logger in loggers:
            logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def preflight(args: argparse.Namespace) -> tuple[TrainConfig | None, str, list[str], list[str]]:
    """``check``, then what depends on this machine: the device, the memory, the cores.
    Returns (the config, or None on errors; the device; errors; notices)."""
    config, errors, notices = check(args)
    try:
        device, notice = choose_device(args.device, max(1, args.nproc), torch.cuda.device_count())
    except ValueError as exc:
        return None, "cpu", [*errors, str(exc)], notices
    notices += [notice] if notice else []
    if config is None:
        return None, device, errors, notices
    if not args.auto:  # --auto's search fits the memory itself
        world = node_range(args)[0].start * args.nproc  # the fewest ranks: the most memory each
        errors = _memory_problems(config, world, args.nproc, device)
        if errors:
            return None, device, errors, notices
    return config, device, [], notices + (_core_notices(config, args.nproc) if device == "cpu" else [])


def run(args: argparse.Namespace) -> int:
    config, device, errors, notices = preflight(args)
    for line in notices:
        print(f"fullshard train: {line}", file=sys.stderr)
    if config is None:
        for line in "\n".join(errors).splitlines():
            print(f"fullshard train: {line}", file=sys.stderr)
        return 2
    prediction = None
    if args.auto:  # the ranks get the plan's first choice
        try:
            config, prediction = train_auto.choose(config, max(1, args.nproc), device, args)
        except ValueError as exc:
            print(f"fullshard train: {exc}", file=sys.stderr)
            return 2
        config, metrics = train_auto.metrics_path(config)
    # torchrun would set 1 thread per rank (and warn); the ranks set their own count.
    os.environ.setdefault("OMP_NUM_THREADS", str(config.threads or max(1, (os.cpu_count() or 1) // args.nproc)))
    try:
        with _ranks_see(device), _quiet_launcher(not config.debug):
            torchrun(parse_torchrun_args(torchrun_arguments(args, config)))
    except ChildFailedError as exc:
        print(_describe_failure(exc, config), file=sys.stderr)
        return 2 if _root_cause(exc)[1].exitcode == 2 else 1
    except SignalException as exc:
        print(
            f"\nfullshard train: stopped by {exc.sigval.name}; every rank has exited." + _checkpoint_hint(config),
            file=sys.stderr,
        )
        return 130
    finally:
        if args.nnodes == "1":  # every rank that could be saving has exited
            remove_unfinished_saves(config)
    if prediction is not None:
        print(train_auto.compare(prediction, metrics))
    return 0


def _memory_problems(config: TrainConfig, world_size: int, nproc: int, device: str) -> list[str]:
    """A model that cannot fit: fullshard plan's peak per rank against this machine's memory (each GPU's,
    or the host's available memory shared by its ranks), before any rank allocates it."""
    plan, _ = predict(config, world_size, config.shard_group_size(world_size, nproc), device)
    have: int | None
    if device == "cuda":
        have = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
        need, where = plan.peak, f"but each GPU has {human_bytes(have or 0)}"
    else:
        have, need = _available_host_memory(), plan.peak * nproc
        where = f"{human_bytes(need)} for the {nproc} rank{'s' if nproc > 1 else ''} on this machine, which has "
        where += f"{human_bytes(have or 0)} available"
    if have is None or need <= have:
        return []
    count = config.model_args().num_params
    return [
        f"--model {config.model} ({count / 1e6:,.0f}M parameters) needs about {human_bytes(plan.peak)} per rank at "
        f"the step's peak over {world_size} rank{'s' if world_size > 1 else ''} (fullshard plan's estimate), {where}: "
        "choose a smaller model (--model, --layers, --dim), a smaller --batch or --seq, or more ranks"
    ]


def _available_host_memory() -> int | None:
    """MemAvailable of /proc/meminfo (Linux); None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _core_notices(config: TrainConfig, nproc: int) -> list[str]:
    """Ranks or threads beyond this machine's CPU cores: each step slower, not wrong."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if nproc > cores:
        return [
            f"warning: --nproc {nproc} ranks on {cores} CPU core{'s' if cores > 1 else ''}: the ranks take turns on "
            "the cores (one thread each), so each step is slower than with fewer ranks"
        ]
    if config.threads and config.threads * nproc > cores:
        return [
            f"warning: --threads {config.threads} for each of {nproc} ranks is {config.threads * nproc} threads on "
            f"{cores} CPU core{'s' if cores > 1 else ''}: they take turns, so each step is slower"
        ]
    return []


def _root_cause(exc: ChildFailedError) -> tuple[int, ProcessFailure]:
    """The failure that started it: a rank killed from outside (not by the launcher's own
    SIGTERM), else the first rank that raised, else the first failure seen."""

    def rank_of_cause(item: tuple[int, ProcessFailure]) -> tuple[int, int, int]:
        rank, failure = item
        if failure.exitcode < 0 and failure.exitcode != -signal.SIGTERM:
            kind = 0
        else:
            kind = 1 if failure.exitcode > 0 else 2
        return kind, failure.timestamp, rank

    return min(exc.failures.items(), key=rank_of_cause)


def _describe_failure(exc: ChildFailedError, config: TrainConfig) -> str:
    """Which rank failed and why, in a few lines."""
    rank, failure = _root_cause(exc)
    if failure.exitcode < 0:
        why = f"was killed by {failure.signal_name()}"
    elif failure.exitcode == 2:  # the rank printed the user's mistake
        why = "stopped on the error above"
    else:
        message = failure.message
        text = (message.get("message", "") if isinstance(message, dict) else str(message)).strip()
        why = f"exited with code {failure.exitcode}" + (f": {text.splitlines()[-1]}" if text else "")
    hint = "" if failure.exitcode == 2 else _checkpoint_hint(config)  # resuming would meet the mistake again
    return f"\nfullshard train: rank {rank} (pid {failure.pid}) {why}\nThe other ranks were stopped." + hint


def _checkpoint_hint(config: TrainConfig) -> str:
    step = saved_step(config)
    if step is None:
        return ""
    return (
        f"\nThe newest complete checkpoint (step {step}) is in {config.checkpoint_dir}: "
        "run the same command with --resume to continue."
    )
