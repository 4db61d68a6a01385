"""fullshard vs PyTorch's FSDP2 on one GPT-like workload, side by side in one run.

    python benchmarks/bench_engine.py                     # 2 ranks, ~32M parameters
    python benchmarks/bench_engine.py --nproc 2 --steps 8 --json out.json

Both frameworks train identical copies of the model (same init, same data) in
the same rank processes; their steps alternate so that machine noise hits both
alike. Reported per framework:

- step time: median over the measured steps (forward, backward, optimizer);
- peak memory per rank: resident memory at its highest during a step. The
  kernel's high-water mark is reset before each step (/proc/self/clear_refs)
  and read after it; the memory steps run in a second pair of processes
  started with glibc's mmap threshold fixed at 64 KiB, so freed tensors go back
  to the OS at once and the high-water mark tracks live memory rather than
  allocator caches;
- bytes per step: data moved through all-gather, reduce-scatter, all-reduce
  and broadcast (full buffers), counted by wrapping torch.distributed's
  functions, which both frameworks call. (On gloo, fullshard gathers with one
  broadcast per rank and reduce-scatters with an in-place all-reduce; the
  logical bytes are the same. See [Note: Gloo collectives] in _core/comm.py.)

Every unit reshards after forward (``reshard_after_forward=True``), so the
ideal is two all-gathers and one reduce-scatter of the (padded) parameters.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from fullshard.models import ModelArgs, Transformer

FRAMEWORKS = ("fullshard", "fsdp2")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=576)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="measured steps per framework")
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--phase", choices=["time", "memory"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# -- measurement helpers (inside a rank) ------------------------------------------------------
class ByteCounter:
    """Counts bytes through torch.distributed's collectives while installed."""

    def __init__(self) -> None:
        self.nbytes = 0

    @contextmanager
    def installed(self) -> Iterator["ByteCounter"]:
        names = ("all_gather_single", "reduce_scatter_single", "all_reduce", "broadcast")
        originals = {name: getattr(dist, name) for name in names}

        def counting(name: str, counted_arg: str) -> Callable:
            signature = inspect.signature(originals[name])

            def wrapper(*args, **kwargs):
                tensor = signature.bind(*args, **kwargs).arguments[counted_arg]
                self.nbytes += tensor.numel() * tensor.element_size()
                return originals[name](*args, **kwargs)

            return wrapper

        dist.all_gather_single = counting("all_gather_single", "output_tensor")  # the full buffer
        dist.reduce_scatter_single = counting("reduce_scatter_single", "input")  # the full buffer
        dist.all_reduce = counting("all_reduce", "tensor")
        dist.broadcast = counting("broadcast", "tensor")  # fullshard's all-gather on gloo
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)


def reset_peak_rss() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS")


def peak_rss() -> int:
    return _status_kib("VmHWM")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


# -- the workload -------------------------------------------------------------------------------
def build(framework: str, model: nn.Module) -> nn.Module:
    if framework == "fullshard":
        from fullshard import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    return model


def persistent_bytes(model: nn.Module, optim: torch.optim.Optimizer) -> int:
    """This rank's shards, gradients and optimizer states."""
    total = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += 2 * local.numel() * local.element_size()  # parameter + gradient
    for state in optim.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    model_args = ModelArgs(
        n_layers=args.layers, vocab_size=256, max_seq_len=args.seq, dim=args.dim, n_heads=args.heads
    )
    torch.manual_seed(0)
    base = Transformer(model_args)
    num_params = sum(p.numel() for p in base.parameters())
    models = {name: build(name, copy.deepcopy(base)) for name in FRAMEWORKS}
    del base
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    generator = torch.Generator().manual_seed(rank)

    def step(name: str) -> None:
        tokens = torch.randint(256, (args.batch, args.seq), generator=generator)
        models[name].loss(tokens, tokens).backward()
        optims[name].step()
        optims[name].zero_grad()

    results: dict = {"num_params": num_params, "world_size": world}
    if args.phase == "time":
        times = {name: [] for name in FRAMEWORKS}
        nbytes = {}
        total = args.warmup + args.steps
        progress = None
        if rank == 0:
            from tqdm import tqdm

            progress = tqdm(total=total * len(FRAMEWORKS), desc="timing (interleaved)")
        for index in range(total):
            for name in FRAMEWORKS:
                dist.barrier()
                counter = ByteCounter()
                with counter.installed():
                    start = time.perf_counter()
                    step(name)
                    elapsed = time.perf_counter() - start
                if index >= args.warmup:
                    times[name].append(elapsed)
                nbytes[name] = counter.nbytes
                if progress:
                    progress.update()
        if progress:
            progress.close()
        for name in FRAMEWORKS:
            results[name] = {"step_s": statistics.median(times[name]), "bytes_per_step": nbytes[name]}
    else:
        peaks = {name: [] for name in FRAMEWORKS}
        for index in range(1 + args.memory_steps):
            for name in FRAMEWORKS:
                dist.barrier()
                before = reset_peak_rss()
                step(name)
                if index > 0:  # the first step allocates optimizer states
                    peaks[name].append(peak_rss() - before)
        for name in FRAMEWORKS:
            transient = max(peaks[name])
            persistent = persistent_bytes(models[name], optims[name])
            results[name] = {"transient_bytes": transient, "persistent_bytes": persistent, "peak_bytes": transient + persistent}
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


# -- launcher -----------------------------------------------------------------------------------
def run_phase(args: argparse.Namespace, phase: str, out: str, env: dict[str, str]) -> list[dict]:
    from fullshard.testing.harness import free_port

    forwarded = [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
        if k not in ("nproc", "json", "phase", "out") and v is not None
    ]
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        __file__, *forwarded, f"--phase={phase}", f"--out={out}",
    ]
    subprocess.run(command, check=True, env={**os.environ, **env})
    with open(out) as f:
        return json.load(f)


def report(timing: list[dict], memory: list[dict], args: argparse.Namespace) -> dict:
    num_params = timing[0]["num_params"]
    world = timing[0]["world_size"]
    param_bytes = 4 * num_params
    ideal = 3 * param_bytes
    mib = 1024**2
    rows = []
    for name in FRAMEWORKS:
        step_s = statistics.median(r[name]["step_s"] for r in timing)
        peak = max(r[name]["peak_bytes"] for r in memory)
        nbytes = timing[0][name]["bytes_per_step"]
        rows.append((name, step_s, peak, nbytes))
    ours, theirs = rows[0], rows[1]
    print(f"\nGPT {num_params / 1e6:.1f}M params, {world} ranks (gloo, CPU), "
          f"{args.batch}x{args.seq} tokens per rank, reshard_after_forward=True")
    print(f"{'framework':<10} {'step (s)':>9} {'peak/rank (MiB)':>16} {'bytes/step (MiB)':>17} {'vs ideal':>9}")
    for name, step_s, peak, nbytes in rows:
        print(f"{name:<10} {step_s:>9.3f} {peak / mib:>16.1f} {nbytes / mib:>17.1f} {nbytes / ideal:>9.4f}")
    ratios = {
        "step_time_ratio": ours[1] / theirs[1],
        "peak_memory_ratio": ours[2] / theirs[2],
        "bytes_ratio_vs_ideal": ours[3] / ideal,
        "bytes_ratio_vs_fsdp2": ours[3] / theirs[3],
    }
    print(f"\nfullshard / fsdp2: step time {ratios['step_time_ratio']:.3f}x, peak memory "
          f"{ratios['peak_memory_ratio']:.3f}x; fullshard bytes / ideal (3 x {param_bytes / mib:.1f} MiB) "
          f"{ratios['bytes_ratio_vs_ideal']:.4f}")
    return {"timing": timing, "memory": memory, "ratios": ratios}


def main() -> None:
    args = parse_args(sys.argv[1:])
    if args.phase is not None:
        worker(args)
        return
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        timing = run_phase(args, "time", os.path.join(tmp, "time.json"), {})
        # Fixed mmap threshold: freed tensors return to the OS, so peak RSS tracks live memory.
        memory = run_phase(
            args, "memory", os.path.join(tmp, "memory.json"),
            {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"},
        )
    results = report(timing, memory, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
