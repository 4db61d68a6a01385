"""Gloo: each way of running a unit's all-gather and reduce-scatter, timed per call.

    python benchmarks/bench_gloo_collectives.py --nproc 2
    python benchmarks/bench_gloo_collectives.py --nproc 4 --json gloo4.json

The choices behind [Note: Gloo collectives] in ``fullshard/_core/comm.py``, for
messages of ``--sizes`` bytes (the whole gathered or reduced buffer, float32):

- all-gather: gloo's own ``all_gather_single`` (one call; two output-sized
  temporaries inside gloo) against one ``broadcast`` per rank straight into the
  output (``W`` calls, no temporaries);
- reduce-scatter: gloo's own ``reduce_scatter_single`` (it clones the input and
  all-reduces the clone), one in-place ``all_reduce`` of the input and a copy of
  this rank's chunk (what fullshard does), one ``reduce`` per rank onto its
  owner (``W`` calls, each moving a chunk), and one all-gather of every rank's
  whole input summed locally (W times the bytes, fewer latency steps).

Each call is issued asynchronously and waited for, as a unit's collectives are;
reported: the median over ``--repeats`` rounds of the mean of ``--calls`` calls,
in microseconds, rank 0's view (all ranks run the same loop).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the benchmarks folder is not a package)

KIB = 1024


def all_gather_ways(world: int, rank: int, numel: int) -> dict[str, Callable[[], None]]:
    source = torch.randn(numel // world)
    output = torch.empty(numel)
    chunks = output.view(world, -1)

    def native() -> None:
        dist.all_gather_into_tensor(output, source, async_op=True).wait()

    def broadcasts() -> None:
        chunks[rank].copy_(source)
        works = [dist.broadcast(chunks[r], src=r, async_op=True) for r in range(world)]
        for work in works:
            work.wait()

    return {"all_gather: native call": native, "all_gather: broadcast per rank": broadcasts}


def reduce_scatter_ways(world: int, rank: int, numel: int) -> dict[str, Callable[[], None]]:
    gradients = torch.randn(numel)
    scratch = torch.empty(numel)
    output = torch.empty(numel // world)

    def native() -> None:
        dist.reduce_scatter_tensor(output, gradients, async_op=True).wait()

    def all_reduce_and_slice() -> None:
        scratch.copy_(gradients)  # fullshard reduces its own copy-in buffer in place
        dist.all_reduce(scratch, async_op=True).wait()
        output.copy_(scratch.view(world, -1)[rank])

    def reduce_per_rank() -> None:
        scratch.copy_(gradients)
        chunks = scratch.view(world, -1)
        works = [dist.reduce(chunks[r], dst=r, async_op=True) for r in range(world)]
        for work in works:
            work.wait()
        output.copy_(chunks[rank])

    def all_gather_and_sum() -> None:
        gathered = torch.empty(world, numel)
        dist.all_gather_into_tensor(gathered.view(-1), gradients, async_op=True).wait()
        torch.sum(gathered.view(world, world, -1)[:, rank], dim=0, out=output)

    return {
        "reduce_scatter: all_gather + local sum": all_gather_and_sum,
        "reduce_scatter: native call": native,
        "reduce_scatter: all_reduce + slice": all_reduce_and_slice,
        "reduce_scatter: reduce per rank": reduce_per_rank,
    }


def time_call(call: Callable[[], None], calls: int, repeats: int) -> float:
    call()  # warm-up: gloo's first use of a size sets up buffers
    rounds = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        rounds.append((time.perf_counter() - start) / calls)
    return statistics.median(rounds) * 1e6


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        results: dict[str, dict[int, float]] = {}
        for size in args.sizes:
            numel = size // 4 // world * world
            ways = {**all_gather_ways(world, rank, numel), **reduce_scatter_ways(world, rank, numel)}
            for name, call in ways.items():
                results.setdefault(name, {})[size] = time_call(call, args.calls, args.repeats)
        return {"world": world, "us": results}
    finally:
        dist.destroy_process_group()


def report(result: dict, sizes: list[int]) -> None:
    print(f"\ngloo, {result['world']} ranks, torch {torch.__version__}: us per call (median of rounds), by buffer size")
    print("| way | " + " | ".join(f"{s // KIB} KiB" for s in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for name, by_size in result["us"].items():
        print(f"| {name} | " + " | ".join(f"{by_size[str(s)]:.0f}" for s in sizes) + " |")  # JSON keys: strings


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--sizes", default="4096,16384,65536,262144,1048576,4194304",
                        help="buffer sizes in bytes, comma-separated")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)  # a rank's result file
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    if args.out is not None:
        result = measure(args)
        if int(os.environ.get("RANK", "0")) == 0:
            with open(args.out, "w") as f:
                json.dump(result, f)
        return
    with tempfile.TemporaryDirectory() as tmp:
        ranks_argv = [f"--sizes={','.join(map(str, args.sizes))}", f"--calls={args.calls}", f"--repeats={args.repeats}"]
        result = common.run_ranks(__file__, args.nproc, ranks_argv, os.path.join(tmp, "out.json"),
                                  env={"OMP_NUM_THREADS": "1"})
    report(result, args.sizes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **result}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
