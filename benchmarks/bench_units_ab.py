"""bench_units.py's model in ONE process: the plain model, fullshard at another commit, this tree's
fullshard and FSDP2, their steps alternating, timed by each step's CPU time on its own thread.

    python benchmarks/bench_units_ab.py --base 2f233a9 --fake-world 8 --steps 40
    python benchmarks/bench_units_ab.py --base HEAD~1 --fake-world 64 --steps 30

For a shared, loaded machine, where wall-clock medians of separate runs move by 2x: every
framework sees the same load step by step, and ``time.thread_time`` leaves out the time the
thread waited for a core. ``--base``'s ``fullshard`` package (``git archive``) is imported under
another name next to this tree's. Reported: the 10th and 25th percentiles and the median per
framework and the ratios to FSDP2 (an A/A run of one tree against itself reads 0.997-0.998x).
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import tarfile
import tempfile
import time

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_units import Unit  # noqa: E402  (the benchmarks folder is not a package)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_PACKAGE = "fullshard_base"


def import_base(rev: str, where: str) -> None:
    """Makes ``rev``'s fullshard package importable as ``fullshard_base`` (its imports are relative)."""
    archive = os.path.join(where, "base.tar")
    subprocess.run(["git", "-C", REPO, "archive", "-o", archive, rev, "fullshard"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(where, filter="data")
    os.rename(os.path.join(where, "fullshard"), os.path.join(where, BASE_PACKAGE))
    sys.path.insert(0, where)


def build(name: str, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[Unit(args.width) for _ in range(args.units)])
    if name != "local":
        module = "torch.distributed.fsdp" if name == "fsdp2" else name
        fully_shard = importlib.import_module(module).fully_shard
        mesh = init_device_mesh("cpu", (args.fake_world,))
        for unit in model:
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--fake-world", type=int, default=8)
    parser.add_argument("--units", type=int, default=128)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from fullshard.testing.fake_group import fake_world

    names = ("local", BASE_PACKAGE, "fullshard", "fsdp2")
    with tempfile.TemporaryDirectory() as where, fake_world(args.fake_world):
        import_base(args.base, where)
        models = {name: build(name, args) for name in names}
        x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1))
        times: dict[str, list[float]] = {name: [] for name in names}
        for index in range(args.warmup + args.steps):
            for name in names if index % 2 else names[::-1]:
                model, optim = models[name]
                start = time.thread_time()
                model(x).square().mean().backward()
                optim.step()
                optim.zero_grad()
                if index >= args.warmup:
                    times[name].append(time.thread_time() - start)
    quantiles = {}
    for name, seconds in times.items():
        ordered = sorted(seconds)
        quantiles[name] = [ordered[len(ordered) * q // 100] * 1e3 for q in (10, 25, 50)]
    print(f"\n{args.units} units, fake world {args.fake_world}, {args.steps} alternating steps, thread time "
          f"(ms: p10, p25, median), base {args.base}, torch {torch.__version__}")
    for name, (p10, p25, p50) in quantiles.items():
        print(f"| {name} | {p10:.2f} | {p25:.2f} | {p50:.2f} |")
    for name in (BASE_PACKAGE, "fullshard"):
        ratios = ", ".join(f"{ours / theirs:.3f}" for ours, theirs in zip(quantiles[name], quantiles["fsdp2"]))
        print(f"{name} / fsdp2 (p10, p25, median): {ratios}")


if __name__ == "__main__":
    main(sys.argv[1:])
