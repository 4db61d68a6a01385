"""The quantized all-gather's cost line on a loaded machine: bench.py's GPT step with the
weights gathered in bf16, int8 and float8, paired step by step, in wall and CPU time.

    python benchmarks/bench_quantized_step.py --nproc 2 --steps 30
    python benchmarks/bench_quantized_step.py --nproc 4 --steps 20
    python benchmarks/bench_quantized_step.py --nproc 2 --steps 30 --front-end wrapper   # flat parameters
    FULLSHARD_CODEC_KERNEL=0 python benchmarks/bench_quantized_step.py ...   # inductor's codec, not the C kernel

The three models (identical copies, bf16 compute, fp32 reduction; ``fully_shard`` per block
and the root, ``set_all_gather_quantization`` with the default rule) train in the same gloo
ranks (``--front-end wrapper``: ``FullyShardedDataParallel`` per block and the root, its
flat parameters, ``use_orig_params=False``). Each round runs one step of each, the order rotating every round, so load that comes
and goes (other jobs on the cores) hits all three alike and no one always runs first. Per
round, each quantized step is divided by the bf16 step of the same round: the median of these
paired ratios is robust to load that moves between rounds, where bench.py's ratio of medians
is not. Also reported: the ratio of median step times, and the same for the CPU time of the
rank processes (``time.process_time``: every thread, gloo's and the kernel's socket copies
included, none of the time a rank waited for a core or a peer), summed over ranks.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from fullshard import (
    AllGatherQuantization,
    FullyShardedDataParallel,
    MixedPrecision,
    MixedPrecisionPolicy,
    fully_shard,
    set_all_gather_quantization,
)
from fullshard._core.manage import states_below
from fullshard.models import ModelArgs, Transformer
from fullshard.wrap import ModuleWrapPolicy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the benchmarks folder is not a package)

GATHERS = {"bf16": None, "int8": torch.int8, "float8": torch.float8_e4m3fn}
# --cast-encode: float8 once more, encoded from a bf16 copy-in of the shards (the engine before it read fp32 shards)
CAST = "float8-cast"


def gathers(args: argparse.Namespace) -> dict[str, torch.dtype | None]:
    return {**GATHERS, CAST: torch.float8_e4m3fn} if args.cast_encode else GATHERS


def encode_from_a_cast_copy_in(model: nn.Module) -> None:
    """Every unit casts its shards into a new bf16 buffer and encodes that (no fp32 read)."""
    for state in states_below(model):
        if state.group is not None:
            state.group.gather._codec_casts = lambda group: False


def sharded(base: nn.Module, code: torch.dtype | None, front_end: str) -> nn.Module:
    model = copy.deepcopy(base)
    if front_end == "wrapper":
        model = FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({type(model.layers[0])}),
            device_id=torch.device("cpu"),
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        )
    else:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    if code is not None:
        set_all_gather_quantization(model, AllGatherQuantization(dtype=code))
    return model


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = Transformer(ModelArgs(n_layers=args.layers, vocab_size=256, max_seq_len=args.seq, dim=args.dim, n_heads=8))
    models = {name: sharded(base, code, args.front_end) for name, code in gathers(args).items()}
    if CAST in models:
        encode_from_a_cast_copy_in(models[CAST])
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    generator = torch.Generator().manual_seed(rank)
    wall: dict[str, list[float]] = {name: [] for name in models}
    cpu: dict[str, list[float]] = {name: [] for name in models}
    names = list(models)
    for round_index in range(args.warmup + args.steps):
        tokens = torch.randint(256, (args.batch, args.seq), generator=generator)
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            logits = models[name](tokens)
            nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
            optims[name].step()
            optims[name].zero_grad()
            if round_index >= args.warmup:
                wall[name].append(time.perf_counter() - start_wall)
                cpu[name].append(time.process_time() - start_cpu)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"wall": wall, "cpu": cpu})
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def report(ranks: list[dict], args: argparse.Namespace) -> dict:
    wall = ranks[0]["wall"]  # the barrier before each step: ranks' walls agree to the slowest
    cpu = {name: [sum(r["cpu"][name][i] for r in ranks) for i in range(args.steps)] for name in gathers(args)}
    print(
        f"bench GPT ({args.layers} x {args.dim}), {args.front_end}, {args.nproc} gloo ranks, bf16 compute, "
        f"{args.steps} rounds"
    )
    print(f"{'gather':<11} {'wall median (s)':>16} {'ratio':>7} {'paired':>7}", end="")
    print(f" {'CPU median (s)':>15} {'ratio':>7} {'paired':>7}")
    result = {}
    for name in gathers(args):
        cells = []
        for times in (wall, cpu):
            paired = statistics.median(q / b for q, b in zip(times[name], times["bf16"]))
            median = statistics.median(times[name])
            cells += [median, median / statistics.median(times["bf16"]), paired]
        result[name] = cells
        print(f"{name:<11} {cells[0]:>16.3f} {cells[1]:>6.3f}x {cells[2]:>6.3f}x", end="")
        print(f" {cells[3]:>15.3f} {cells[4]:>6.3f}x {cells[5]:>6.3f}x")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=576)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="measured rounds (one step of each gather)")
    parser.add_argument("--front-end", choices=["fully_shard", "wrapper"], default="fully_shard")
    parser.add_argument("--cast-encode", action="store_true", help="also float8 encoded from a bf16 copy-in")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ranks.json")
        skip = ("nproc", "json", "worker", "out", "cast_encode")
        forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in skip and v is not None]
        forwarded += ["--cast-encode"] if args.cast_encode else []
        ranks = common.run_ranks(__file__, args.nproc, [*forwarded, "--worker"], out)
    result = report(ranks, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": result}, f)


if __name__ == "__main__":
    main()
