"""fullshard next to PyTorch's FSDP2, FSDP1, DDP and a local run, on one workload, in one run.

    python benchmarks/bench.py                                   # fully_shard vs FSDP2, 2 ranks
    python benchmarks/bench.py --frameworks fullshard-wrapper,fsdp1 --strategy grad-op
    python benchmarks/bench.py --nproc 4 --strategy hybrid --frameworks fullshard-wrapper,fsdp1
    python benchmarks/bench.py --frameworks all --json results.json
    python benchmarks/bench.py --frameworks all --mixed-precision bf16
    python benchmarks/bench.py --frameworks fullshard,fullshard-int8,fullshard-float8 --mixed-precision bf16
    python benchmarks/bench.py --frameworks fullshard-wrapper,fullshard-wrapper-int8,fullshard-wrapper-float8 --mixed-precision bf16
    python benchmarks/bench.py --device cuda --model gpt-1.3b --batch 4 --seq 2048 --mixed-precision bf16
    python benchmarks/bench.py --device cuda --fake-world 8 --model gpt-7b --batch 1 --seq 2048 --mixed-precision bf16
    python benchmarks/bench.py --device cpu --fake-world 8 --model gpt-tiny --steps 1   # smoke check

``--device cuda`` or ``--fake-world N`` runs in this process, one framework
after another (see ``device_mode.py``); the rest of this docstring is the CPU
mode (the default), several gloo ranks:

Every framework trains an identical copy of a GPT-like model (same init, same
data) in the same rank processes; their steps alternate so that machine noise
hits all alike. Reported per framework:

- step time: median over the measured steps (forward, backward, optimizer);
- peak memory per rank: resident memory at its highest during a step. The
  kernel's high-water mark is reset before each step (/proc/self/clear_refs)
  and read after it; the memory steps run in a second set of processes started
  with glibc's mmap threshold fixed at 64 KiB, so freed tensors go back to the
  OS at once and the high-water mark tracks live memory, not allocator caches.
  Reported as the step's rise above the resident set before it, plus what the
  rank holds between steps (parameters and optimizer states; gradients are
  freed by ``zero_grad`` and counted in the rise);
- ``fullshard-checked``: fully_shard with execution-order validation on (the
  DETAIL debug level at its lazy initialisation); its ratio to ``fullshard``
  is what the check costs. At other levels the validator does not exist;
- ``fullshard-int8`` / ``fullshard-float8`` (``fullshard-wrapper-int8`` / ``-float8``: the
  wrapper, its flat parameters): fully_shard with its weights gathered as
  block-wise codes (``set_all_gather_quantization``, default rule: norms and
  embeddings exact); their rows also show the time per step spent quantizing
  and dequantizing (the profiler's ``fullshard::all_gather_(de)quantize`` ranges);
- bytes per step: data passed to all-gather, reduce-scatter, all-reduce and
  broadcast (full buffers), counted by wrapping torch.distributed's functions,
  which the FSDP implementations call, and through a DDP communication hook.
  (On gloo, fullshard gathers with one broadcast per rank and reduce-scatters
  with an in-place all-reduce; the bytes are the same. See [Note: Gloo
  collectives] in fullshard/_core/comm.py.)

Strategies: ``full`` reshards every unit after forward (fully_shard also the
root; the FSDP1-style wrappers keep the root, as FSDP1 does); ``grad-op``
keeps parameters after forward (ZeRO-2); ``hybrid`` shards within groups of
nproc/2 ranks ("nodes") and replicates across them. The ideal for ``full`` is
two all-gathers and one reduce-scatter of the padded parameters.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from fullshard.models import ModelArgs, Transformer, TransformerBlock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the benchmarks folder is not a package)

ALL_FRAMEWORKS = ("fullshard", "fsdp2", "fullshard-wrapper", "fsdp1", "ddp", "local", "fullshard-checked")
COUNTERPART = {"fullshard": "fsdp2", "fullshard-wrapper": "fsdp1", "fullshard-checked": "fullshard"}
# fully_shard with execution-order validation: its first forward (lazy init) runs at the DETAIL
# debug level, which turns the validator on for good; the level then goes back to the default,
# so the process groups and every other framework stay unchanged.
CHECKED = "fullshard-checked"
# fully_shard, or the wrapper (its flat parameters), with a quantized all-gather (not in "all":
# the counterpart of each is the same front end gathering in the compute dtype)
QUANTIZED = {"fullshard-int8": torch.int8, "fullshard-float8": torch.float8_e4m3fn}
QUANTIZED_WRAPPER = {"fullshard-wrapper-int8": torch.int8, "fullshard-wrapper-float8": torch.float8_e4m3fn}
COUNTERPART.update(dict.fromkeys(QUANTIZED, "fullshard"))
COUNTERPART.update(dict.fromkeys(QUANTIZED_WRAPPER, "fullshard-wrapper"))
QUANTIZED.update(QUANTIZED_WRAPPER)
CODEC_LABELS = ("fullshard::all_gather_quantize", "fullshard::all_gather_dequantize")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--frameworks", default=None,
                        help=f"comma-separated, or 'all': {', '.join(ALL_FRAMEWORKS)} (default: fullshard,fsdp2; "
                        "device mode: every row it runs)")
    parser.add_argument("--strategy", choices=["full", "grad-op", "hybrid"], default="full")
    parser.add_argument("--mixed-precision", choices=["bf16"], default=None,
                        help="compute in bf16, reduce gradients in fp32 (DDP and local: CPU autocast)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=576)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="measured steps per framework")
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: one process, world 1 over NCCL or --fake-world (see device_mode.py)")
    parser.add_argument("--fake-world", type=int, default=None,
                        help="run as rank 0 of N on torch's fake process group (one process)")
    parser.add_argument("--model", default=None, help="a fullshard.models preset (device mode); else --layers/--dim")
    parser.add_argument("--peak-tflops", type=float, default=None, help="for MFU (default: by GPU name)")
    parser.add_argument("--phase", choices=["time", "memory"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    given = args.frameworks
    args.frameworks = ALL_FRAMEWORKS if given == "all" else tuple((given or "fullshard,fsdp2").split(","))
    unknown = set(args.frameworks) - set(ALL_FRAMEWORKS) - set(QUANTIZED)
    if unknown:
        parser.error(f"unknown frameworks {sorted(unknown)}; choose from {', '.join((*ALL_FRAMEWORKS, *QUANTIZED))}")
    if args.strategy == "hybrid" and args.nproc % 2:
        parser.error("--strategy hybrid needs an even --nproc (two 'nodes')")
    args.device_mode = args.device == "cuda" or args.fake_world is not None
    if args.device_mode:
        from device_mode import DEVICE_FRAMEWORKS, DEVICE_QUANTIZED

        from fullshard.models import get_preset

        if given is None:  # all rows in device mode
            args.frameworks = DEVICE_FRAMEWORKS
        unsupported = set(args.frameworks) - set(DEVICE_FRAMEWORKS) - set(DEVICE_QUANTIZED)
        if unsupported or args.strategy != "full":
            parser.error(f"device mode runs {', '.join((*DEVICE_FRAMEWORKS, *DEVICE_QUANTIZED))} with --strategy full")
        args.model_args = (
            get_preset(args.model, max_seq_len=args.seq)
            if args.model
            else ModelArgs(n_layers=args.layers, vocab_size=256, max_seq_len=args.seq, dim=args.dim, n_heads=args.heads)
        )
    return args


# -- the frameworks (inside a rank) -------------------------------------------------------------
class ByteCounter:
    """Counts bytes through torch.distributed's collectives while installed."""

    # The tensor collectives' names differ between torch versions (``*_single`` is newer, see
    # fullshard/_core/compat.py): count whichever this torch has, by the argument holding the buffer.
    COUNTED = {name: arg for name, arg in {
        "all_gather_single": "output_tensor", "reduce_scatter_single": "input",
        "all_gather_into_tensor": "output_tensor", "reduce_scatter_tensor": "input",
        "all_reduce": "tensor", "broadcast": "tensor",
        "all_gather": "tensor_list",  # FSDP1 gathers into a list on CPU
    }.items() if hasattr(dist, name)}

    def __init__(self) -> None:
        self.nbytes = 0
        self._depth = 0  # a collective implemented by another (``*_single`` by ``*_tensor``) counts once

    def add(self, tensor: torch.Tensor | list[torch.Tensor]) -> None:
        for t in tensor if isinstance(tensor, list) else [tensor]:
            self.nbytes += t.numel() * t.element_size()

    @contextmanager
    def installed(self) -> Iterator["ByteCounter"]:
        originals = {name: getattr(dist, name) for name in self.COUNTED}

        def counting(name: str) -> Callable:
            signature = inspect.signature(originals[name])

            def wrapper(*args, **kwargs):
                if not self._depth:
                    self.add(signature.bind(*args, **kwargs).arguments[self.COUNTED[name]])
                self._depth += 1
                try:
                    return originals[name](*args, **kwargs)
                finally:
                    self._depth -= 1

            return wrapper

        for name in self.COUNTED:
            setattr(dist, name, counting(name))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)


def _hybrid_mesh(args: argparse.Namespace):
    """Two "nodes": shard within each half of the ranks, replicate across the halves."""
    from fullshard import hybrid_mesh

    return hybrid_mesh("cpu", num_devices_per_node=dist.get_world_size() // 2)


def build(name: str, model: nn.Module, args: argparse.Namespace, counter_box: list[ByteCounter]) -> nn.Module:
    """``model`` prepared by framework ``name`` for ``args.strategy``."""
    cpu = torch.device("cpu")
    if name in ("fullshard", "fsdp2", CHECKED) or name in QUANTIZED and name not in QUANTIZED_WRAPPER:
        if name != "fsdp2":
            from fullshard import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard
        if name != "fsdp2":
            from fullshard import MixedPrecisionPolicy
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy
        # the mesh pinned to the CPU: the default one would take a GPU where there is one
        mesh = _hybrid_mesh(args) if args.strategy == "hybrid" else init_device_mesh("cpu", (dist.get_world_size(),))
        reshard = args.strategy != "grad-op"
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.mixed_precision \
            else MixedPrecisionPolicy()
        for layer in model.layers:
            fully_shard(layer, reshard_after_forward=reshard, mesh=mesh, mp_policy=mp)
        model = fully_shard(model, reshard_after_forward=reshard, mesh=mesh, mp_policy=mp)
        if name in QUANTIZED:
            from fullshard import AllGatherQuantization, set_all_gather_quantization

            set_all_gather_quantization(model, AllGatherQuantization(dtype=QUANTIZED[name]))
        return model
    if name in ("fullshard-wrapper", "fsdp1", *QUANTIZED_WRAPPER):
        if name != "fsdp1":
            from fullshard import FSDP, MixedPrecision, ShardingStrategy
            from fullshard.wrap import ModuleWrapPolicy
        else:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        strategy = {"full": "FULL_SHARD", "grad-op": "SHARD_GRAD_OP", "hybrid": "HYBRID_SHARD"}[args.strategy]
        groups = None
        if args.strategy == "hybrid":
            mesh = _hybrid_mesh(args)
            groups = (mesh.get_group("shard"), mesh.get_group("replicate"))
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.mixed_precision else None
        model = FSDP(model, sharding_strategy=ShardingStrategy[strategy], process_group=groups,
                     auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}), device_id=cpu, mixed_precision=mp)
        if name in QUANTIZED_WRAPPER:
            from fullshard import AllGatherQuantization, set_all_gather_quantization

            set_all_gather_quantization(model, AllGatherQuantization(dtype=QUANTIZED[name]))
        return model
    if name == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)

        def counted_allreduce(state, bucket):
            counter_box[0].add(bucket.buffer())
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, counted_allreduce)
        return ddp
    return model  # local: this rank's batch, no communication


def codec_seconds(run_step: Callable[[], None]) -> float:
    """CPU time one step spends quantizing and dequantizing (the engine's profiler ranges)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run_step()
    return sum(e.cpu_time_total for e in profile.key_averages() if e.key.startswith(CODEC_LABELS)) / 1e6


def persistent_bytes(model: nn.Module, optim: torch.optim.Optimizer) -> int:
    """What this rank holds between steps: parameters and optimizer states (``zero_grad``
    frees the gradients; those alive at the peak are part of the measured rise)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    for state in optim.state.values():
        total += sum(local(v).numel() * local(v).element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return total


@contextmanager
def debug_level(level: dist.DebugLevel | None) -> Iterator[None]:
    """``level`` inside the block (None: unchanged)."""
    previous = dist.get_debug_level()
    if level is not None:
        dist.set_debug_level(level)
    try:
        yield
    finally:
        dist.set_debug_level(previous)


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    model_args = ModelArgs(n_layers=args.layers, vocab_size=256, max_seq_len=args.seq, dim=args.dim, n_heads=args.heads)
    torch.manual_seed(0)
    base = Transformer(model_args)
    num_params = sum(p.numel() for p in base.parameters())
    counter_box = [ByteCounter()]
    models = {name: build(name, copy.deepcopy(base), args, counter_box) for name in args.frameworks}
    del base
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    generator = torch.Generator().manual_seed(rank)

    started: set[str] = set()

    def step(name: str) -> None:
        tokens = torch.randint(256, (args.batch, args.seq), generator=generator)
        model = models[name]
        autocast = args.mixed_precision and name in ("ddp", "local")
        with debug_level(dist.DebugLevel.DETAIL if name == CHECKED and name not in started else None), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(autocast)):
            logits = model(tokens)
        started.add(name)
        nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
        optims[name].step()
        optims[name].zero_grad()

    results: dict = {"num_params": num_params, "world_size": world}
    progress = None
    if rank == 0:
        from tqdm import tqdm

        steps = args.warmup + args.steps if args.phase == "time" else 1 + args.memory_steps
        progress = tqdm(total=steps * len(args.frameworks), desc=f"{args.phase} ({args.strategy}, interleaved)")
    if args.phase == "time":
        times: dict[str, list[float]] = {name: [] for name in args.frameworks}
        for index in range(args.warmup + args.steps):
            for name in args.frameworks:
                dist.barrier()
                counter_box[0] = ByteCounter()
                with counter_box[0].installed():
                    start = time.perf_counter()
                    step(name)
                    elapsed = time.perf_counter() - start
                if index >= args.warmup:
                    times[name].append(elapsed)
                results.setdefault(name, {})["bytes_per_step"] = counter_box[0].nbytes
                if progress:
                    progress.update()
        for name in args.frameworks:
            results[name]["step_s"] = statistics.median(times[name])
            if name in QUANTIZED:
                results[name]["codec_s"] = codec_seconds(lambda: step(name))
    else:
        peaks: dict[str, list[int]] = {name: [] for name in args.frameworks}
        for index in range(1 + args.memory_steps):
            for name in args.frameworks:
                dist.barrier()
                before = common.reset_peak_rss()
                step(name)
                if index > 0:  # the first step allocates optimizer states
                    peaks[name].append(common.peak_rise(before))
                if progress:
                    progress.update()
        for name in args.frameworks:
            persistent = persistent_bytes(models[name], optims[name])
            results[name] = {"peak_bytes": max(peaks[name]) + persistent, "persistent_bytes": persistent}
    if progress:
        progress.close()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


# -- launcher -----------------------------------------------------------------------------------
def run_phase(args: argparse.Namespace, phase: str, out: str, env: dict[str, str]) -> list[dict]:
    forwarded = [
        f"--{key.replace('_', '-')}={','.join(value) if isinstance(value, tuple) else value}"
        for key, value in vars(args).items()
        if key not in ("nproc", "json", "phase", "out", "device_mode") and value is not None
    ]
    return common.run_ranks(__file__, args.nproc, [*forwarded, f"--phase={phase}"], out, env)


def report(timing: list[dict], memory: list[dict], args: argparse.Namespace) -> dict:
    num_params, world = timing[0]["num_params"], timing[0]["world_size"]
    # two all-gathers in the compute dtype, one reduce-scatter in fp32
    gather_bytes = 2 if args.mixed_precision else 4
    ideal = (2 * gather_bytes + 4) * num_params
    mib = 1024**2
    rows = {}
    for name in args.frameworks:
        rows[name] = {
            "step_s": statistics.median(r[name]["step_s"] for r in timing),
            "peak_mib": max(r[name]["peak_bytes"] for r in memory) / mib,
            "bytes_mib": timing[0][name]["bytes_per_step"] / mib,
        }
    print(f"\nGPT {num_params / 1e6:.1f}M params, {world} ranks (gloo, CPU), {args.batch}x{args.seq} "
          f"tokens per rank, strategy {args.strategy}, {args.mixed_precision or 'fp32'}")
    print(f"{'framework':<18} {'step (s)':>9} {'peak/rank (MiB)':>16} {'bytes/step (MiB)':>17} {'bytes/ideal':>12}")
    for name, row in rows.items():
        print(f"{name:<18} {row['step_s']:>9.3f} {row['peak_mib']:>16.1f} {row['bytes_mib']:>17.1f} "
              f"{row['bytes_mib'] * mib / ideal:>12.4f}")
    base = "fullshard" if "fullshard" in rows else next(iter(rows))
    print(f"\nratios to {base} (below 1: less than {base})")
    print(f"{'framework':<18} {'step time':>10} {'peak memory':>12} {'bytes':>8}")
    for name, row in rows.items():
        cells = [row[key] / rows[base][key] if rows[base][key] else float("nan")
                 for key in ("step_s", "peak_mib", "bytes_mib")]
        print(f"{name:<18} {cells[0]:>9.3f}x {cells[1]:>11.3f}x {cells[2]:>7.3f}x")
    ratios = {}
    print("\nours / theirs:")
    for ours, theirs in COUNTERPART.items():
        if ours in rows and theirs in rows:
            ratios[f"{ours}/{theirs}"] = {
                key: rows[ours][key] / rows[theirs][key] if rows[theirs][key] else None
                for key in ("step_s", "peak_mib", "bytes_mib")
            }
            r = ratios[f"{ours}/{theirs}"]
            print(f"  {ours} / {theirs}: step time {r['step_s']:.3f}x, peak memory {r['peak_mib']:.3f}x, "
                  f"bytes {r['bytes_mib']:.4f}x")
    for name in rows:
        if name in QUANTIZED:
            rows[name]["codec_s"] = statistics.median(r[name]["codec_s"] for r in timing)
            print(f"  {name}: quantize + dequantize {1e3 * rows[name]['codec_s']:.1f} ms per step "
                  f"({100 * rows[name]['codec_s'] / rows[name]['step_s']:.1f}% of its step)")
    print(f"(ideal bytes for full sharding: 2 all-gathers of {gather_bytes * num_params / mib:.1f} MiB and one "
          f"reduce-scatter of {4 * num_params / mib:.1f} MiB)")
    return {"args": {k: v for k, v in vars(args).items() if k not in ("phase", "out")}, "rows": rows, "ratios": ratios}


def main() -> None:
    args = parse_args(sys.argv[1:])
    if args.device_mode:
        import device_mode

        results = device_mode.run(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        return
    if args.phase is not None:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        timing = run_phase(args, "time", os.path.join(tmp, "time.json"), {})
        # Fixed mmap threshold: freed tensors return to the OS, so peak RSS tracks live memory.
        memory = run_phase(args, "memory", os.path.join(tmp, "memory.json"), common.MEMORY_ENV)
    results = report(timing, memory, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
