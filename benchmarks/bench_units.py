"""Per-unit overhead: many small units, fullshard next to torch's FSDP2 and FSDP1, in one run.

    python benchmarks/bench_units.py --fake-world 8      # one process, rank 0 of 8 on torch's fake group
    python benchmarks/bench_units.py --fake-world 64
    python benchmarks/bench_units.py --nproc 2           # gloo ranks on this machine (torchrun)
    python benchmarks/bench_units.py --nproc 4 --json units.json

The model is ``--units`` (128) units of ``Linear(--width, --width) + ReLU``, each
its own FSDP unit (and the root), batch ``--batch`` (4), SGD: a model whose step
is bound by the CPU time of FSDP's own hooks, not by math or wire (MoE experts,
deep narrow stacks, LoRA). Every framework trains an identical copy in the same
process(es) and their steps alternate, so machine noise hits all alike:

- ``local``: the plain model, no FSDP (this rank's batch, no communication);
- ``fullshard`` / ``fsdp2``: ``fully_shard`` on every unit and the root;
- ``fullshard-wrapper`` / ``fsdp1``: the FSDP1 wrapper, one wrapped unit per block.

Reported per framework: the median (and min-max) over ``--steps`` of the step,
its forward, backward and optimizer step (wall time; on gloo a barrier before
each step), the step's CPU time (``time.process_time``: every thread of the
process, gloo's included; on a loaded machine it leaves out the time a rank
waited for a core, though not the time it waited for its peer), the step's time
per unit, and the ratios fullshard / FSDP2 and wrapper / FSDP1 (wall and CPU).
``--count-steps N`` adds the Python and builtin calls per unit and step (cProfile:
deterministic, immune to load), or with ``--callgrind`` the instructions of those
steps. Then a per-stage breakdown of ``--profile-steps`` steps under
``torch.profiler`` (with Python stacks, so the absolute times are inflated; the
shares are what counts): every event's own CPU time goes to the innermost
category among its callers, so an allocation inside a hook counts as an
allocation:

- ``collectives``: torch.distributed calls (and fullshard's ``comm.py``);
- ``DTensor``: DTensor and DTensorSpec construction;
- ``allocations``: ``aten::empty*``, ``zeros``, storage ``resize_``;
- ``copies``: ``aten::copy_``, ``split_with_sizes_copy``, ``_foreach_copy_``,
  ``cat`` (all-gather copy-in/out, reduction copy-in);
- ``grad accumulation``: autograd's ``AccumulateGrad``;
- ``hooks``: the rest of the framework's own Python (fullshard, torch's FSDP,
  the ``torch.compiler.disable`` wrappers around hooks);
- ``model + optimizer``: everything outside the framework's code.

and the time inside each profiler label (``fullshard::<stage>`` and torch's
``FSDP::<stage>`` ranges, inclusive, summed over units).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the benchmarks folder is not a package)

FRAMEWORKS = ("local", "fullshard", "fsdp2", "fullshard-wrapper", "fsdp1")
COUNTERPART = {"fullshard": "fsdp2", "fullshard-wrapper": "fsdp1"}
PHASES = ("step", "forward", "backward", "optimizer")
MEASURES = (*PHASES, "cpu")  # cpu: the step's process CPU time


class Unit(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.linear(x))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fake-world", type=int, default=None, help="one process on torch's fake group")
    parser.add_argument("--nproc", type=int, default=2, help="gloo ranks (without --fake-world)")
    parser.add_argument("--units", type=int, default=128)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=35)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=2, help="0: no breakdown")
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    parser.add_argument("--gloo-all-gather-bytes", type=int, default=None,
                        help="override comm.GLOO_NATIVE_ALL_GATHER_BYTES (0: every all-gather by broadcasts)")
    parser.add_argument("--gloo-reduce-scatter-bytes", type=int, default=None,
                        help="override comm.GLOO_GATHERED_REDUCE_SCATTER_BYTES (0: every reduce-scatter by all-reduce)")
    parser.add_argument("--count-steps", type=int, default=0,
                        help="also count Python and builtin calls per unit and step over this many steps (cProfile)")
    parser.add_argument("--callgrind", action="store_true",
                        help="with --count-steps, under `valgrind --tool=callgrind --instr-atstart=no`: count the "
                             "instructions of those steps instead (callgrind's Collected / steps; one framework)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)  # a rank's result file (gloo)
    args = parser.parse_args(argv)
    args.frameworks = args.frameworks.split(",")
    unknown = set(args.frameworks) - set(FRAMEWORKS)
    if unknown:
        parser.error(f"unknown frameworks {sorted(unknown)}; choose from {','.join(FRAMEWORKS)}")
    return args


def build(name: str, model: nn.Module, world: int) -> nn.Module:
    mesh = init_device_mesh("cpu", (world,))
    if name in ("fullshard", "fsdp2"):
        if name == "fullshard":
            from fullshard import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard
        for unit in model:
            fully_shard(unit, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if name in ("fullshard-wrapper", "fsdp1"):
        if name == "fullshard-wrapper":
            from fullshard import FSDP
            from fullshard.wrap import ModuleWrapPolicy
        else:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Unit}), device_id=torch.device("cpu"))
    return model


class Trainer:
    """One framework's model, optimizer and timings."""

    def __init__(self, name: str, model: nn.Module, world: int, barrier: Callable[[], None]) -> None:
        self.name = name
        self.model = build(name, model, world)
        self.optim = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.barrier = barrier
        self.times: dict[str, list[float]] = {measure: [] for measure in MEASURES}
        self.losses: list[float] = []

    def step(self, x: torch.Tensor, record: bool) -> None:
        self.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = self.model(x).square().mean()
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        self.optim.step()
        self.optim.zero_grad()
        end, cpu_end = time.perf_counter(), time.process_time()
        if record:
            spans = (end - start, forward - start, backward - forward, end - backward, cpu_end - cpu_start)
            for measure, seconds in zip(MEASURES, spans):
                self.times[measure].append(seconds)
            self.losses.append(loss.item())


# -- breakdown ---------------------------------------------------------------------
_CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("collectives", ("distributed_c10d.py", "c10d::", "record_param_comms", "fullshard/_core/comm.py", "gloo:")),
    ("DTensor", ("distributed/tensor/_api.py", "distributed/tensor/_dtensor_spec.py", "dtensor_of_local")),
    ("allocations", ("aten::empty", "aten::zeros", "method resize_", "aten::new_empty", "aten::new_zeros")),
    ("copies", ("aten::copy_", "aten::split_with_sizes_copy", "aten::_foreach_copy_", "aten::cat", "aten::_chunk_cat")),
    ("grad accumulation", ("AccumulateGrad",)),
    ("hooks", ("fullshard/", "torch/distributed/fsdp/", "torch/_dynamo/eval_frame.py", "torch/distributed/utils.py")),
)


def _category(name: str) -> str | None:
    for category, needles in _CATEGORIES:
        if any(needle in name for needle in needles):
            return category
    return None


def breakdown(trainer: Trainer, x: torch.Tensor, steps: int) -> dict:
    """Own CPU time (ms per step) by category and by profiler label; see the docstring."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(steps):
            trainer.step(x, record=False)
    by_category: dict[str, float] = {}
    by_label: dict[str, float] = {}
    for event in prof.events():
        where, node = None, event
        while node is not None and where is None:
            where, node = _category(node.name), node.cpu_parent
        key = where or "model + optimizer"
        by_category[key] = by_category.get(key, 0.0) + event.self_cpu_time_total / 1e3 / steps
        if event.name.startswith(("fullshard::", "FSDP::")):
            label = event.name.split("(")[0].split(" for ")[0].strip()
            by_label[label] = by_label.get(label, 0.0) + event.cpu_time_total / 1e3 / steps
    return {"by_category": by_category, "by_label": by_label}


def count(trainer: Trainer, x: torch.Tensor, steps: int, units: int, callgrind: bool) -> dict:
    """Python and builtin calls per unit and step (deterministic: immune to the machine's load),
    or, under ``--callgrind``, the steps with callgrind's instruction counting switched on."""
    if callgrind:
        switch = ["callgrind_control", "-i"]
        subprocess.run([*switch, "on", str(os.getpid())], check=True, stdout=subprocess.DEVNULL)
        for _ in range(steps):
            trainer.step(x, record=False)
        subprocess.run([*switch, "off", str(os.getpid())], check=True, stdout=subprocess.DEVNULL)
        return {}
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        trainer.step(x, record=False)
    profile.disable()
    calls = {"python": 0, "builtin": 0}
    for (filename, _, _), (_, num_calls, _, _, _) in pstats.Stats(profile).stats.items():
        calls["builtin" if filename == "~" else "python"] += num_calls
    return {kind: num / (steps * (units + 1)) for kind, num in calls.items()}


# -- one process (fake group or one gloo rank) ---------------------------------------
@contextlib.contextmanager
def process_group(args: argparse.Namespace) -> Iterator[tuple[int, Callable[[], None]]]:
    if args.fake_world:
        from fullshard.testing.fake_group import fake_world

        with fake_world(args.fake_world):
            yield args.fake_world, lambda: None
        return
    dist.init_process_group("gloo")
    try:
        yield dist.get_world_size(), dist.barrier
    finally:
        dist.destroy_process_group()


def _set_gloo_bounds(args: argparse.Namespace) -> None:
    """The gloo rules' size bounds, when a run compares them ([Note: Gloo collectives])."""
    from fullshard._core import comm

    if args.gloo_all_gather_bytes is not None:
        comm.GLOO_NATIVE_ALL_GATHER_BYTES = args.gloo_all_gather_bytes
    if args.gloo_reduce_scatter_bytes is not None:
        comm.GLOO_GATHERED_REDUCE_SCATTER_BYTES = args.gloo_reduce_scatter_bytes


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    _set_gloo_bounds(args)
    with process_group(args) as (world, barrier):
        torch.manual_seed(0)
        reference = nn.Sequential(*[Unit(args.width) for _ in range(args.units)])
        trainers = [Trainer(name, copy.deepcopy(reference), world, barrier) for name in args.frameworks]
        rank = dist.get_rank()
        torch.manual_seed(1 + rank)
        x = torch.randn(args.batch, args.width)
        for index in range(args.warmup + args.steps):
            order = trainers if index % 2 == 0 else trainers[::-1]
            for trainer in order:
                trainer.step(x, record=index >= args.warmup)
        result: dict = {"world": world, "backend": "fake" if args.fake_world else "gloo", "frameworks": {}}
        for trainer in trainers:
            entry: dict = {measure: _stats(trainer.times[measure]) for measure in MEASURES}
            entry["first_losses"] = trainer.losses[:3]
            if args.profile_steps:
                entry["breakdown"] = breakdown(trainer, x, args.profile_steps)
            if args.count_steps:
                entry["calls"] = count(trainer, x, args.count_steps, args.units, args.callgrind)
            result["frameworks"][trainer.name] = entry
        return result


def _stats(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1e3 for s in seconds]
    return {"median": statistics.median(ms), "min": min(ms), "max": max(ms)}


# -- report --------------------------------------------------------------------------
def report(result: dict, args: argparse.Namespace) -> None:
    frameworks = result["frameworks"]
    where = f"fake world {result['world']}" if result["backend"] == "fake" else f"gloo, {result['world']} ranks"
    print(f"\n{args.units} units of Linear({args.width}, {args.width}) + ReLU, batch {args.batch}, SGD; {where}; "
          f"median (min-max) of {args.steps} steps, torch {torch.__version__}")
    print("| framework | step ms | forward ms | backward ms | optimizer ms | CPU ms | per unit and step |")
    print("|---|---|---|---|---|---|---|")
    for name, entry in frameworks.items():
        cells = [f"{entry[p]['median']:.1f} ({entry[p]['min']:.1f}-{entry[p]['max']:.1f})" for p in MEASURES]
        per_unit = entry["step"]["median"] / args.units * 1e3
        print(f"| {name} | {' | '.join(cells)} | {per_unit:.0f} us |")
    for ours, theirs in COUNTERPART.items():
        if ours in frameworks and theirs in frameworks:
            ratio = frameworks[ours]["step"]["median"] / frameworks[theirs]["step"]["median"]
            line = f"{ours} / {theirs}: step {ratio:.3f}x"
            if "local" in frameworks:
                plain = frameworks["local"]["step"]["median"]
                over = (frameworks[ours]["step"]["median"] - plain) / (frameworks[theirs]["step"]["median"] - plain)
                line += f", overhead above the plain model {over:.3f}x"
            cpu = frameworks[ours]["cpu"]["median"] / frameworks[theirs]["cpu"]["median"]
            print(f"{line}; CPU time {cpu:.3f}x")
    for name, entry in frameworks.items():
        if entry.get("calls"):
            calls = entry["calls"]
            print(f"{name}: {calls['python']:.1f} Python and {calls['builtin']:.1f} builtin calls per unit and step")
    if not args.profile_steps:
        return
    categories = [c for c, _ in _CATEGORIES] + ["model + optimizer"]
    print(f"\nown CPU time by category, ms per step under the profiler (with stacks; {args.profile_steps} steps):")
    print("| framework | " + " | ".join(categories) + " |")
    print("|---|" + "---|" * len(categories))
    for name, entry in frameworks.items():
        cats = entry["breakdown"]["by_category"]
        print(f"| {name} | " + " | ".join(f"{cats.get(c, 0.0):.1f}" for c in categories) + " |")
    print("\ntime inside profiler labels, ms per step (inclusive, summed over units):")
    for name, entry in frameworks.items():
        labels = sorted(entry["breakdown"]["by_label"].items(), key=lambda kv: -kv[1])
        if labels:
            print(f"{name}: " + ", ".join(f"{label} {ms:.1f}" for label, ms in labels))


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.out is not None:  # a gloo rank started below
        result = measure(args)
        if int(os.environ.get("RANK", "0")) == 0:
            with open(args.out, "w") as f:
                json.dump(result, f)
        return
    if args.fake_world:
        result = measure(args)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            # the ranks' own arguments, without --nproc (torchrun would take it for --nproc-per-node)
            ranks_argv = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                          if k in ("units", "width", "batch", "steps", "warmup", "profile_steps", "count_steps",
                                   "gloo_all_gather_bytes", "gloo_reduce_scatter_bytes") and v is not None]
            ranks_argv.append("--frameworks=" + ",".join(args.frameworks))
            result = common.run_ranks(__file__, args.nproc, ranks_argv, os.path.join(tmp, "out.json"),
                                      env={"OMP_NUM_THREADS": "1"})
    report(result, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **result}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
