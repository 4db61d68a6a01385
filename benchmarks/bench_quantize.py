"""How the block size of a quantized all-gather trades bytes, error and time.

    python benchmarks/bench_quantize.py                 # the bench GPT's weights (8 x 576), CPU
    python benchmarks/bench_quantize.py --trained 300   # after 300 steps of fullshard train's corpus
    python benchmarks/bench_quantize.py --unit           # eager vs fused codec on one block unit
    python benchmarks/bench_quantize.py --unit --block-sizes 64,128,256   # ... at several block sizes

For each code (int8, float8_e4m3fn) and block size: the bytes on the wire per value
relative to bf16, the relative RMS error of the decoded weights (all coded matrices
together), and the encode + decode time per million values on this machine's CPU
(one thread). The default block size (``AllGatherQuantization.block_size``) is the
smallest one under 0.52x of bf16's bytes whose error is close to the smallest.

``--unit``: the codec of one bench GPT block unit (4.0M values, norms exact, bf16
compute) as ``QuantizedGather`` runs it, encode of one rank's chunk and decode of
all chunks into the parameters, eager vs fused (see [Note: Fused codec] in
``fullshard/_core/gather/codec/fused_codec.py``; compile time included once), at 2 and 4 ranks,
alternating, next to the bf16 gather's copy-out that the decode replaces. Those
encode the bf16 chunk; ``fp32`` encodes the fp32 shards directly, as the engine
does under bf16 compute, in place of the cast copy-in into a new buffer
(``copy-in``, as the engine did before) and the encode of its result.
``kernel`` and ``kernel-fp32`` are the same two encodes by the C kernel
(see [Note: Codec kernel] in ``fullshard/_core/gather/codec/codec_kernel.py``), which also
decodes; ``fused`` and ``fp32`` are inductor's loops with the kernel turned off.
``--cpu-time``: each call's thread CPU time instead of wall time (steadier on a
shared machine).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from fullshard._core.gather.codec import codec_kernel, fused_codec
from fullshard._core.layout import Layout
from fullshard._core.gather.codec.quantize import BlockQuantizer
from fullshard._core.gather.codec.quantized_gather import QuantizedGather
from fullshard.models import ModelArgs, Transformer

BLOCK_SIZES = (32, 64, 128, 256, 1024)
# --unit's codecs: eager ops, inductor's loops (from the bf16 chunk or the fp32 shards), the C kernel (the same two).
PATHS = ("eager", "fused", "fp32", "kernel", "kernel-fp32")


def coded_weights(args: argparse.Namespace) -> torch.Tensor:
    """The matrices the default rule codes (2-D, not embeddings), back to back."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(n_layers=8, vocab_size=256, max_seq_len=128, dim=576, n_heads=8))
    if args.trained:
        train(model, args.trained)
    weights = [p.detach().reshape(-1) for n, p in model.named_parameters() if p.dim() >= 2 and "embeddings" not in n]
    return torch.cat(weights)


def train(model: Transformer, steps: int) -> None:
    from fullshard.training.corpus import Corpus

    corpus, optim = Corpus(), torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        inputs, targets = corpus.batch(step, 0, 8, 128)
        model.loss(inputs, targets).backward()
        optim.step()
        optim.zero_grad()


def measure(quantizer: BlockQuantizer, values: torch.Tensor) -> tuple[float, float, float]:
    """(bytes vs bf16, relative RMS error, seconds per million values)."""
    packed = torch.empty(1, quantizer.packed_numel(values.numel()), dtype=torch.uint8)
    scratch = torch.empty_like(values)  # encode scales its input in place
    times = []
    for _ in range(3):
        scratch.copy_(values)
        start = time.perf_counter()
        quantizer.encode(scratch, packed[0])
        decoded = quantizer.decode(packed, values.numel())
        times.append(time.perf_counter() - start)
    error = (decoded[0] - values).norm() / values.norm()
    return packed.numel() / (2 * values.numel()), error.item(), min(times) / values.numel() * 1e6


def _cast_copy_in(shards: torch.Tensor) -> torch.Tensor:
    """What ``AllGather.input`` did before the codec read fp32 shards: a new bf16 buffer, cast into."""
    return torch.empty(shards.numel(), dtype=torch.bfloat16).copy_(shards)


def unit_codec(reps: int, block_sizes: list[int], clock: Callable[[], float]) -> None:
    """Eager vs fused ``QuantizedGather`` on one bench GPT block (ms, min / median of ``reps``)."""
    # Every (ranks, code, block size) is a layout of its own: let all of them compile.
    fused_codec.MAX_FUSED_LAYOUTS = torch._dynamo.config.recompile_limit = 8 * len(block_sizes) + 2
    block = Transformer(ModelArgs(n_layers=1, vocab_size=256, max_seq_len=128, dim=576, n_heads=8)).layers[0]
    params = list(block.parameters())
    print(
        f"one block unit, {sum(p.numel() for p in params) / 1e6:.1f}M values, bf16 compute; ms, min / median of {reps}"
    )
    print(
        f"{'ranks':>5} {'code':<15} {'block':>5} {'path':<11} {'encode':>14} {'decode':>14} {'bf16 copy-out':>14}"
        f" {'copy-in':>14} {'compile (s)':>12}"
    )
    for world in (2, 4):
        layout = Layout.build([-(-p.numel() // world) for p in params], [torch.bfloat16] * len(params))
        shards = torch.randn(layout.total)
        source = shards.to(torch.bfloat16)
        outputs = [torch.empty(size * world, dtype=torch.bfloat16) for size in layout.sizes]
        bf16_gathered = torch.cat([source] * world)
        for code, block_size in [(code, size) for code in (torch.int8, torch.float8_e4m3fn) for size in block_sizes]:
            codecs = {
                path: QuantizedGather(BlockQuantizer(code, block_size), [p.dim() < 2 for p in params]) for path in PATHS
            }
            gathered = torch.cat([codecs["eager"].encode(source, layout)] * world)
            row = torch.empty_like(gathered[: gathered.numel() // world])  # the engine encodes into its gather row
            fused_codec.MIN_FUSED_VALUES, codec_kernel._State.disabled = 0, True
            start = time.perf_counter()
            codecs["fused"].encode(source, layout, row)
            codecs["fused"].decode(gathered, world, layout, outputs)
            codecs["fp32"].encode(shards, layout, row)
            compile_s = time.perf_counter() - start
            times: dict[str, list[float]] = {}
            for _ in range(reps):
                for path, codec in codecs.items():
                    fused_codec.MIN_FUSED_VALUES = 1 << 40 if path == "eager" else 0
                    codec_kernel._State.disabled = not path.startswith("kernel")
                    calls = {
                        "encode": (codec.encode, (shards if "fp32" in path else source, layout, row)),
                        "decode": (codec.decode, (gathered, world, layout, outputs)),
                        "copy-out": (layout.copy_out, (bf16_gathered, world, outputs)),
                        "copy-in": (_cast_copy_in, (shards,)),
                    }
                    for name, (call, call_args) in calls.items():
                        start = clock()
                        call(*call_args)
                        times.setdefault(f"{path} {name}", []).append(1e3 * (clock() - start))
            for path in codecs:
                cells = [
                    f"{min(times[f'{path} {n}']):.2f} / {sorted(times[f'{path} {n}'])[reps // 2]:.2f}"
                    for n in ("encode", "decode", "copy-out", "copy-in")
                ]
                compiled = f"{compile_s:.1f}" if path == "fused" else ""
                print(
                    f"{world:>5} {str(code).removeprefix('torch.'):<15} {block_size:>5} {path:<11} {cells[0]:>14}"
                    f" {cells[1]:>14} {cells[2]:>14} {cells[3]:>14} {compiled:>12}"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trained", type=int, default=0, help="train this many steps first")
    parser.add_argument("--unit", action="store_true", help="eager vs fused codec on one block unit instead")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--block-sizes", default="128", help="--unit: comma-separated block sizes")
    parser.add_argument("--cpu-time", action="store_true", help="--unit: thread CPU time, not wall time")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.unit:
        clock = time.thread_time if args.cpu_time else time.perf_counter
        unit_codec(args.reps, [int(size) for size in args.block_sizes.split(",")], clock)
        return
    values = coded_weights(args)
    print(
        f"{values.numel() / 1e6:.1f}M coded values ({'trained ' + str(args.trained) + ' steps' if args.trained else 'at init'})"
    )
    print(f"{'code':<15} {'block':>6} {'bytes vs bf16':>14} {'rel. RMS error':>15} {'ms per 1M values':>17}")
    for code in (torch.int8, torch.float8_e4m3fn):
        for block_size in BLOCK_SIZES:
            ratio, error, seconds = measure(BlockQuantizer(code, block_size), values)
            print(
                f"{str(code).removeprefix('torch.'):<15} {block_size:>6} {ratio:>13.4f}x {error:>15.5f} {1e3 * seconds:>17.2f}"
            )


if __name__ == "__main__":
    main()
