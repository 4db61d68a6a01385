"""Tensor-subclass parameters: fully_shard next to torch's FSDP2 on torchao's NF4 (QLoRA) and float8.

    python benchmarks/bench_subclass.py                 # 2 gloo ranks, 4 blocks of dim 1024, 10 steps
    python benchmarks/bench_subclass.py --dim 2048 --steps 20

Each rank builds the same model twice (same seed), one per framework, and the
two train alternately on the same batches, so machine noise hits both alike.
Reported per workload: the median time of each framework and their ratio, and
the bytes fullshard's all-gathers carried (comm spy) next to what the same
weights would cost gathered in their high-precision dtype.
- nf4: a training step (forward, backward, AdamW) of frozen 4-bit base weights
  with trainable rank-16 adapters;
- float8: ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``; every
  block gathered and freed once (``unshard()``/``reshard()``: the amax
  all-reduce, the fp8 cast, the all-gather, the rebuild), not a step: CPU's
  fp8 matmul takes seconds. torch's FSDP2 runs it on gloo because every block
  also holds an fp32 bias.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fullshard import fully_shard  # noqa: E402
from fullshard._core import comm  # noqa: E402
from fullshard.testing import run_distributed  # noqa: E402
from fullshard.testing.models import NF4LoRALinear  # noqa: E402


def build(workload: str, dim: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    if workload == "nf4":
        return nn.Sequential(*[nn.Sequential(NF4LoRALinear(dim, rank=16), nn.Tanh()) for _ in range(layers)])
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(layers)])
    return convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))


def high_precision_bytes(model: nn.Module) -> int:
    """What one all-gather of every parameter costs in its high-precision dtype."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def step(model: nn.Module, optim: torch.optim.Optimizer, inputs: torch.Tensor) -> float:
    start = time.perf_counter()
    model(inputs).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()
    return time.perf_counter() - start


def gather(model: nn.Module, optim: torch.optim.Optimizer, inputs: torch.Tensor) -> float:
    """Every block gathered and freed once (float8: CPU's fp8 matmul takes seconds, so no step)."""
    start = time.perf_counter()
    for block in model:
        block.unshard()
        block.reshard()
    return time.perf_counter() - start


def measure(workload: str, dim: int, layers: int, tokens: int, steps: int) -> dict[str, Any]:
    models = {}
    for name, shard in (("fullshard", fully_shard), ("FSDP2", torch_fully_shard)):
        model = build(workload, dim, layers)
        for block in model:
            shard(block)
        shard(model)
        model.unshard()  # lazy initialization, as the root's first forward would do
        params = [p for p in model.parameters() if p.requires_grad]
        models[name] = (model, torch.optim.AdamW(params, lr=1e-4))
    times: dict[str, list[float]] = {name: [] for name in models}
    nbytes = 0
    for index in range(steps + 2):  # two warm-up steps
        inputs = torch.randn(tokens, dim, generator=torch.Generator().manual_seed(index + dist.get_rank()))
        for name, (model, optim) in models.items():
            with comm.record_comms() as records:
                seconds = (step if workload == "nf4" else gather)(model, optim, inputs)
            if index >= 2:
                times[name].append(seconds)
            if name == "fullshard":
                nbytes = sum(r.nbytes for r in records if r.op == "all_gather")
    full = high_precision_bytes(build(workload, dim, layers))
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {"workload": workload, **medians, "all_gather_bytes": nbytes, "high_precision_bytes": full}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, 2 gloo ranks, {args.layers} blocks of dim {args.dim}, {args.tokens} tokens/rank")
    print("| workload | fullshard (s) | FSDP2 (s) | ratio | all-gather bytes | vs high precision |")
    print("|---|---|---|---|---|---|")
    for workload in ("nf4", "float8"):
        row = run_distributed(measure, 2, workload, args.dim, args.layers, args.tokens, args.steps, timeout=1200)[0]
        ratio = row["fullshard"] / row["FSDP2"]
        # A step gathers each block twice (forward, backward); the float8 loop once.
        saving = row["all_gather_bytes"] / ((2 if workload == "nf4" else 1) * row["high_precision_bytes"])
        print(
            f"| {workload} | {row['fullshard']:.3f} | {row['FSDP2']:.3f} | {ratio:.3f}x | "
            f"{row['all_gather_bytes'] / 2**20:.2f} MiB | {saving:.3f}x |"
        )


if __name__ == "__main__":
    main()
