"""Where a quantized all-gather's time goes, pass by pass, next to a bf16 one, on gloo ranks.

    python benchmarks/bench_quantized_gather.py --nproc 2
    python benchmarks/bench_quantized_gather.py --nproc 4 --reps 30

One unit of ``bench.py``'s GPT (a transformer block, 8 x 576 by default: 4.0M values,
norms and biases kept exact as the default rule does), gathered over every rank the
way fullshard does it: copy-in (this rank's fp32 shard cast to bf16), then

- bf16: the all-gather, then the copy-out into the unsharded parameters;
- int8 / float8_e4m3fn: quantize (``QuantizedGather.encode``, into this rank's row of the
  gather output), the all-gather of the codes, dequantize (``decode``, straight into the
  bf16 parameters).

The three gathers alternate within each repetition (a barrier before every pass), so
machine noise hits all alike. Reported: each pass's median and minimum (rank 0), and
per bench GPT step (two gathers per block and step) the codec's time against the
gather time it saves: the quantized gather pays when ``encode + gather + decode`` is
under ``gather + copy-out`` of bf16.
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

from fullshard._core import comm
from fullshard._core.layout import Layout
from fullshard._core.gather.codec.quantize import BlockQuantizer
from fullshard._core.gather.codec.quantized_gather import QuantizedGather
from fullshard.models import ModelArgs, Transformer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (the benchmarks folder is not a package)

CODES = {"int8": torch.int8, "float8": torch.float8_e4m3fn}


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, group = dist.get_world_size(), dist.group.WORLD
    model_args = ModelArgs(n_layers=1, vocab_size=256, max_seq_len=128, dim=args.dim, n_heads=args.heads)
    params = list(Transformer(model_args).layers[0].parameters())
    layout = Layout.build([-(-p.numel() // world) for p in params], [torch.bfloat16] * len(params))
    shard = torch.randn(layout.total)  # fp32, as the sharded parameters are kept
    staged = torch.empty(layout.total, dtype=torch.bfloat16)
    outputs = [torch.empty(size * world, dtype=torch.bfloat16) for size in layout.sizes]
    bf16_gathered = torch.empty(layout.total * world, dtype=torch.bfloat16)
    codecs = {
        name: QuantizedGather(BlockQuantizer(code, args.block_size), [p.dim() < 2 for p in params])
        for name, code in CODES.items()
    }
    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[..., object], *fn_args: object) -> None:
        dist.barrier()
        start = time.perf_counter()
        fn(*fn_args)
        times.setdefault(name, []).append(time.perf_counter() - start)

    for rep in range(args.warmup + args.reps):
        if rep == args.warmup:
            times.clear()
        timed("copy-in", staged.copy_, shard)
        timed("bf16 gather", comm.all_gather, bf16_gathered, staged, group, False)
        timed("bf16 copy-out", layout.copy_out, bf16_gathered, world, outputs)
        for name, codec in codecs.items():
            gathered = torch.empty(world, codec.packed_numel(layout), dtype=torch.uint8)
            row = gathered[dist.get_rank()]  # the engine encodes into its row: the gather copies nothing in
            timed(f"{name} quantize", codec.encode, staged, layout, row)
            timed(f"{name} gather", comm.all_gather, gathered, row, group, False)
            timed(f"{name} dequantize", codec.decode, gathered, world, layout, outputs)
    results = {
        "world": world,
        "numel": sum(p.numel() for p in params),
        "bf16_bytes": 2 * layout.total,
        "int8_bytes": codecs["int8"].packed_numel(layout),
        "times": times,
    }
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def report(results: dict, layers: int) -> None:
    ms = {name: (1e3 * statistics.median(t), 1e3 * min(t)) for name, t in results["times"].items()}
    print(
        f"one block unit: {results['numel'] / 1e6:.1f}M values, {results['world']} gloo ranks; bytes sent per "
        f"rank: bf16 {results['bf16_bytes']:,}, codes {results['int8_bytes']:,}"
    )
    print(f"{'pass':<20} {'median (ms)':>12} {'min (ms)':>9}")
    for name, (median, low) in ms.items():
        print(f"{name:<20} {median:>12.2f} {low:>9.2f}")
    gathers = 2 * layers  # forward and backward, per block unit
    bf16 = ms["bf16 gather"][0] + ms["bf16 copy-out"][0]
    print(f"\nper step ({gathers} block gathers; medians): bf16 gather + copy-out {gathers * bf16:.0f} ms")
    for name in CODES:
        codec = ms[f"{name} quantize"][0] + ms[f"{name} dequantize"][0]
        saved = ms["bf16 gather"][0] - ms[f"{name} gather"][0]
        total = codec + ms[f"{name} gather"][0]
        print(
            f"  {name}: quantize + dequantize {gathers * codec:.0f} ms, gather {gathers * saved:.0f} ms shorter than "
            f"bf16's; codec + gather {gathers * total:.0f} ms ({total / bf16:.2f}x of bf16's gather + copy-out)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8, help="block units per step (bench.py's GPT)")
    parser.add_argument("--dim", type=int, default=576)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase is not None:
        worker(args)
        return
    forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("nproc", "phase", "out")]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        results = common.run_ranks(__file__, args.nproc, [*forwarded, "--phase=worker"], out)
    report(results, args.layers)


if __name__ == "__main__":
    main()
