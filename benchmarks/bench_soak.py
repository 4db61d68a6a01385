"""Soak: build, step, state dict, delete, a thousand times; what does the process keep?

    python benchmarks/bench_soak.py                       # 1,000 cycles, 2 gloo ranks, fullshard and FSDP2
    python benchmarks/bench_soak.py --cycles 200 --group-cycles 20 --config hsdp

Each rank runs two loops per framework, fullshard's and torch's FSDP2 (the same
model, the same step), one framework after the other in the same processes:

- ``--cycles`` model cycles in one process group: build the small model of
  fullshard/testing/lifecycle.py, shard it (``--config``, one of lifecycle.CONFIGS;
  FSDP2 gets its counterpart where there is one, else plain FULL_SHARD), two
  AdamW steps, a model and optimizer state dict, ``del``;
- ``--group-cycles`` cycles that also create the default process group before
  the model and destroy it after (a leaked group keeps its gloo threads).

Every tenth of a loop it samples the resident set, the bytes of live tensors
(counted through the garbage collector) and the thread count; the table is the
first sample, the last, and the largest rise after the first tenth (warm-up). Flat is the goal.
Memory runs with glibc's mmap threshold fixed (common.MEMORY_ENV), so freed
tensors leave the resident set at once.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import MEMORY_ENV, status_bytes  # noqa: E402

from fullshard.testing.lifecycle import CONFIGS, after_step, shard_as, small_model, thread_count  # noqa: E402


def _torch_shard(config: str, model: torch.nn.Sequential) -> torch.nn.Module:
    """FSDP2's counterpart of ``config`` (plain FULL_SHARD where it has none)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict = {}
    if config == "reshard_after_forward=False":
        kwargs["reshard_after_forward"] = False
    elif config == "offload":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    elif config == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in list(model)[:-1]:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def one_cycle(framework: str, config: str) -> None:
    model = small_model()
    sharded = shard_as(config, model) if framework == "fullshard" else _torch_shard(config, model)
    optim = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    for _ in range(2):
        sharded(torch.randn(4, 16)).sum().backward()
        optim.step()
        optim.zero_grad()
    if framework == "fullshard":
        after_step(config, sharded, optim)
    import contextlib

    from torch.distributed.checkpoint.state_dict import get_state_dict

    import fullshard

    # torch's state-dict API knows fullshard's FSDP1 wrapper once pointed at it (docs/api.md).
    with fullshard.use_in_place_of_torch() if framework == "fullshard" else contextlib.nullcontext():
        get_state_dict(sharded, optim)
    del model, sharded, optim


def live_tensor_bytes() -> int:
    gc.collect()
    total = 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            try:
                total += obj.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):  # DTensors and other wrappers: their locals count
                pass
    return total


def sample() -> dict[str, int]:
    return {"rss": status_bytes("VmRSS"), "tensor_bytes": live_tensor_bytes(), "threads": thread_count()}


def soak(framework: str, config: str, cycles: int, with_groups: bool, store: dist.Store, rank: int, world: int) -> list:
    samples = []
    every = max(1, cycles // 10)
    for index in range(cycles):
        if with_groups:
            prefix = dist.PrefixStore(f"{framework}/{index}/", store)
            dist.init_process_group("gloo", store=prefix, rank=rank, world_size=world)
        one_cycle(framework, config)
        if with_groups:
            dist.destroy_process_group()
        if index % every == 0 or index == cycles - 1:
            samples.append({"cycle": index + 1, **sample()})
            if rank == 0:
                print(f"  {framework:9s} {'groups' if with_groups else 'models'} {index + 1}/{cycles}", flush=True)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--group-cycles", type=int, default=100)
    parser.add_argument("--config", default="full", choices=CONFIGS)
    parser.add_argument("--frameworks", default="fullshard,fsdp2")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]) + 1,
        world,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=120),
    )
    results = {}
    for framework in args.frameworks.split(","):
        start = time.perf_counter()
        dist.init_process_group("gloo", store=dist.PrefixStore(f"{framework}/main", store), rank=rank, world_size=world)
        models = soak(framework, args.config, args.cycles, False, store, rank, world)
        dist.destroy_process_group()
        groups = soak(framework, args.config, args.group_cycles, True, store, rank, world)
        results[framework] = {"models": models, "groups": groups, "seconds": time.perf_counter() - start}
    if rank == 0:
        report(results, args)


def _rise(samples: list, key: str) -> int:
    """The largest rise after the first tenth of the loop (the first cycles fill caches that
    live as long as the process: dispatch tables, compiled kernels, allocator pools)."""
    settled = samples[1:] or samples
    return max(s[key] for s in settled) - settled[0][key]


def report(results: dict, args: argparse.Namespace) -> None:
    mib = 1 << 20
    print(
        f"\nsoak: config {args.config}, {args.cycles} model cycles and {args.group_cycles} group cycles per framework"
    )
    print(
        f"{'framework':10s} {'loop':7s} {'RSS first -> last (MiB)':>24s} {'rise after warm-up':>19s} "
        f"{'tensor bytes first -> last':>28s} {'threads first -> last':>22s} {'s':>6s}"
    )
    for framework, loops in results.items():
        for loop in ("models", "groups"):
            samples = loops[loop]
            first, last = samples[0], samples[-1]
            print(
                f"{framework:10s} {loop:7s} {first['rss'] / mib:11.1f} -> {last['rss'] / mib:8.1f} "
                f"{_rise(samples, 'rss') / mib:19.1f} {first['tensor_bytes']:13d} -> {last['tensor_bytes']:11d} "
                f"{first['threads']:10d} -> {last['threads']:8d} {loops['seconds']:6.0f}"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    if "RANK" not in os.environ:  # launched by hand: start the ranks through torchrun
        import subprocess

        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            os.path.abspath(__file__),
            *sys.argv[1:],
        ]
        sys.exit(subprocess.run(command, env={**os.environ, **MEMORY_ENV}).returncode)
    main()
