"""The quantized all-gather's codec on one bench GPT block unit, per-parameter rows next to the
FSDP1 wrapper's flat pieces (see [Note: Quantized flat chunks] in fullshard/_core/gather/codec/quantized_gather.py).

    PYTHONPATH=$PWD python benchmarks/bench_quantized_flat.py                  # dim 576, 2 ranks, int8
    PYTHONPATH=$PWD python benchmarks/bench_quantized_flat.py --world 4 --code float8

One process, one thread: the encode of rank 0's chunk and the decode of every rank's, min and
median over ``--reps`` (ms), both layouts alternating. CPU units of this size take the fused
(compiled) codec: the first calls compile it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fullshard._core.layout import Layout, flat_pieces
from fullshard._core.gather.codec.quantize import BlockQuantizer
from fullshard._core.gather.codec.quantized_gather import QuantizedGather
from fullshard.models import ModelArgs
from fullshard.plan.units import model_units

CODES = {"int8": torch.int8, "float8": torch.float8_e4m3fn}


def setups(dim: int, world: int, code: torch.dtype) -> dict[str, tuple[QuantizedGather, list[Layout], list[int]]]:
    """Per layout: its codec, each rank's layout, the unsharded storages' sizes."""
    block = model_units(ModelArgs(n_layers=1, vocab_size=256, max_seq_len=128, dim=dim, n_heads=8), world)[1]
    numels, exact = [rows * row for rows, row in block.shapes], list(block.exact)
    dtypes = [torch.bfloat16] * len(numels)
    quantizer = BlockQuantizer(code, 128)
    rows = [-(-r // world) * c for r, c in block.shapes]
    chunk, pieces = flat_pieces(numels, world)
    flat = [Layout.build([p[r][1] - p[r][0] for p in pieces], dtypes, flat_chunk=chunk) for r in range(world)]
    return {
        "rows": (QuantizedGather(quantizer, exact), [Layout.build(rows, dtypes)] * world, [s * world for s in rows]),
        "flat": (QuantizedGather(quantizer, exact, pieces), flat, numels),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=576)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--code", choices=list(CODES), default="int8")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = {}
    for name, (codec, layouts, sizes) in setups(args.dim, args.world, CODES[args.code]).items():
        sources = [torch.randn(layout.total).to(torch.bfloat16) for layout in layouts]
        outputs = [torch.empty(size, dtype=torch.bfloat16) for size in sizes]
        gathered = torch.cat([codec.encode(source, layout) for source, layout in zip(sources, layouts)])
        runs[name] = (
            lambda c=codec, s=sources[0], lay=layouts[0]: c.encode(s, lay),
            lambda c=codec, g=gathered, lay=layouts[0], o=outputs: c.decode(g, args.world, lay, o),
        )
    times: dict[tuple[str, str], list[float]] = {}
    for rep in range(3 + args.reps):  # the first three compile and warm up
        for name, passes in runs.items():
            for label, run in zip(("encode", "decode"), passes):
                start = time.perf_counter()
                run()
                if rep >= 3:
                    times.setdefault((name, label), []).append(1e3 * (time.perf_counter() - start))
    print(f"bench GPT block (dim {args.dim}), {args.world} ranks, {args.code}, bf16, ms min / median")
    for (name, label), values in times.items():
        print(f"{name:<5} {label}: {min(values):.2f} / {statistics.median(values):.2f}")


if __name__ == "__main__":
    main()
