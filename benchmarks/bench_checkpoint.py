"""Checkpoint save and load: fullshard.checkpoint vs FSDP2 with torch.distributed.checkpoint.

    python benchmarks/bench_checkpoint.py                 # 2 ranks, the ~32M-parameter GPT of bench.py
    python benchmarks/bench_checkpoint.py --repeats 5 --json out.json

Both models are trained one step (so AdamW has its states), then saved and
loaded alternately, ``--repeats`` times each after one unmeasured round (the
first save and load of a process pay for imports and first-use allocations,
which would otherwise land on whichever framework goes first), into fresh
folders:

- fullshard: ``fullshard.checkpoint.save(path, model, optim)`` / ``load(...)``
  (sharded state dicts, a manifest with sizes and CRC-32, an atomic LATEST
  pointer; load verifies every file first);
- FSDP2: ``get_state_dict`` -> ``dcp.save``, and ``get_state_dict`` ->
  ``dcp.load`` -> ``set_state_dict``, the torch recipe.

Reported per framework and operation: the median wall time (after a barrier)
and the peak rise of resident memory above the resident set before the
operation (see common.py; memory runs in their own processes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from fullshard.models import ModelArgs, Transformer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the benchmarks folder is not a package)

FRAMEWORKS = ("fullshard", "fsdp2")
OPERATIONS = ("save", "load")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=576)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--phase", choices=["time", "memory"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build(name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    if name == "fullshard":
        from fullshard import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = Transformer(ModelArgs(n_layers=ARGS.layers, vocab_size=256, max_seq_len=128, dim=ARGS.dim, n_heads=8))
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(256, (2, 128), generator=torch.Generator().manual_seed(dist.get_rank()))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def operation(name: str, op: str, model, optim, path: str) -> None:
    if name == "fullshard":
        from fullshard import checkpoint

        if op == "save":
            checkpoint.save(path, model, optim)
        else:
            checkpoint.load(path, model, optim)
        return
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    if op == "save":
        dcp.save(state, checkpoint_id=path)
    else:
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    built = {name: build(name) for name in FRAMEWORKS}
    results: dict[str, dict[str, list[float]]] = {n: {op: [] for op in OPERATIONS} for n in FRAMEWORKS}
    for repeat in range(-1, args.repeats):  # repeat -1 warms up (imports, first-use allocations)
        for name in FRAMEWORKS:
            path = os.path.join(args.dir, f"{name}-{repeat}")
            for op in OPERATIONS:
                dist.barrier()
                before = common.reset_peak_rss()
                start = time.perf_counter()
                operation(name, op, *built[name], path)
                elapsed = time.perf_counter() - start
                if repeat >= 0:
                    results[name][op].append(elapsed if args.phase == "time" else common.peak_rise(before))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def main() -> None:
    global ARGS
    ARGS = args = parse_args(sys.argv[1:])
    if args.phase is not None:
        worker(args)
        return
    if args.dir is not None:
        os.makedirs(args.dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        forwarded = [f"--layers={args.layers}", f"--dim={args.dim}", f"--repeats={args.repeats}", f"--dir={tmp}"]
        timing = common.run_ranks(__file__, args.nproc, [*forwarded, "--phase=time"], os.path.join(tmp, "t.json"))
        memory = common.run_ranks(__file__, args.nproc, [*forwarded, "--phase=memory"], os.path.join(tmp, "m.json"),
                                  common.MEMORY_ENV)
    mib = 1024**2
    rows = {}
    for name in FRAMEWORKS:
        rows[name] = {
            op: {
                "s": statistics.median(max(r[name][op][i] for r in timing) for i in range(args.repeats)),
                "peak_mib": max(max(r[name][op]) for r in memory) / mib,
            }
            for op in OPERATIONS
        }
    print(f"\ncheckpoint of a {args.layers}-layer dim-{args.dim} GPT + AdamW, {args.nproc} ranks (slowest rank per repeat)")
    print(f"{'framework':<10} {'save (s)':>9} {'save peak (MiB)':>16} {'load (s)':>9} {'load peak (MiB)':>16}")
    for name, row in rows.items():
        print(f"{name:<10} {row['save']['s']:>9.3f} {row['save']['peak_mib']:>16.1f} "
              f"{row['load']['s']:>9.3f} {row['load']['peak_mib']:>16.1f}")
    ratios = {op: {k: rows['fullshard'][op][k] / rows['fsdp2'][op][k] for k in ("s", "peak_mib")} for op in OPERATIONS}
    print(f"fullshard / fsdp2: save {ratios['save']['s']:.3f}x time, {ratios['save']['peak_mib']:.3f}x memory; "
          f"load {ratios['load']['s']:.3f}x time, {ratios['load']['peak_mib']:.3f}x memory")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "ratios": ratios}, f, indent=2)


ARGS: argparse.Namespace


if __name__ == "__main__":
    main()
