"""``fullshard plan`` for models that are not ours: predicted against measured peak and step time, on gloo ranks.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_plan_any_model.py              # 2 ranks, the three models
    PYTHONPATH=. .venv/bin/python benchmarks/bench_plan_any_model.py --nproc 4 --write

For each model (a Llama and a GPT-2 built from transformers configs, a user-style
ConvNet: the models of tests/test_plan_any_model.py, larger here so a step is
compute-bound enough to time), every candidate below is predicted by
``fullshard.plan`` with this machine's calibrated profile (``--calibrate``) and
run for real (median of the timed steps). Reported: the predicted and measured
peak per rank, step times, Spearman's rank correlation of the two step-time
orders (and of the pairs the plan calls more than 15% apart, how many the
measurement orders the same way: near-ties are the noise's to order), and
whether the first choice under a memory limit (the median of the candidates'
predicted peaks, plus 1%) fits it when run. ``--write`` appends the tables to
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import test_plan_any_model  # noqa: E402

from fullshard.plan import Choice  # noqa: E402
from fullshard.plan.calibrate import calibrate  # noqa: E402
from fullshard.plan.measure import measure_choice  # noqa: E402
from fullshard.plan.playback import predict  # noqa: E402
from fullshard.plan.step_time import StepClock  # noqa: E402
from fullshard.plan.trace import trace_step  # noqa: E402
from fullshard.testing import run_distributed  # noqa: E402

VOCAB, SEQ = 512, 64


def llama() -> nn.Module:
    return test_plan_any_model.llama(width=128, layers=4, vocab=VOCAB, seq=SEQ)


def gpt2() -> nn.Module:
    return test_plan_any_model.gpt2(width=128, layers=4, vocab=VOCAB, seq=SEQ)


def tokens(n: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(VOCAB, (n, SEQ))
    return {"input_ids": ids, "labels": ids}


def convnet() -> nn.Module:
    return test_plan_any_model.ConvNet(channels=32, blocks=4)


def images(n: int) -> torch.Tensor:
    return torch.randn(n, 3, 24, 24)


MODELS = {"llama": (llama, tokens), "gpt2": (gpt2, tokens), "convnet": (convnet, images)}


def candidates(world: int, per_rank: int) -> list[Choice]:
    """Choices whose step times differ for reasons the model claims to see: micro-batches (more
    collectives), recomputation, offload's host copies, replication's all-reduce."""
    found = [
        Choice(world, "full", micro_batch=per_rank),
        Choice(world, "full", micro_batch=per_rank // 2, accumulation=2),
        Choice(world, "full", micro_batch=per_rank // 4, accumulation=4),
        Choice(world, "grad-op", micro_batch=per_rank),
        Choice(world, "no-shard", micro_batch=per_rank),
        Choice(world, "full", micro_batch=per_rank, checkpointing=True),
        Choice(world, "full", micro_batch=per_rank // 4, accumulation=4, checkpointing=True),
        Choice(world, "full", micro_batch=per_rank, cpu_offload=True),
    ]
    return [Choice(**{**c.__dict__, "device": "cpu", "ranks_per_node": world}) for c in found]


def measure_all(name: str, choices: list[Choice], timed_steps: int) -> list[dict]:
    model_fn, batch_fn = MODELS[name]
    return [measure_choice(model_fn, batch_fn, c, timed_steps=timed_steps) for c in choices]


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        for rank, index in enumerate(order):
            result[index] = float(rank)
        return result

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def decisive_pairs(predicted: list[float], measured: list[float], margin: float = 0.15) -> tuple[int, int]:
    """(pairs the plan calls apart by more than ``margin``, of those the measurement orders the same way)."""
    called = agreed = 0
    for i in range(len(predicted)):
        for j in range(i + 1, len(predicted)):
            slow, fast = (i, j) if predicted[i] > predicted[j] else (j, i)
            if predicted[slow] > (1 + margin) * predicted[fast]:
                called += 1
                agreed += measured[slow] > measured[fast]
    return called, agreed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--per-rank", type=int, default=8, help="samples per rank and step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per candidate")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--write", action="store_true", help="append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    profile = calibrate(ranks=args.nproc)
    print(f"calibrated: {profile.matmul_flops['float32'] / 1e9:.1f} GFLOP/s fp32, memory "
          f"{profile.memory_bandwidth / 1e9:.1f} GB/s, gloo {profile.intra_node_bandwidth / 1e9:.2f} GB/s")
    choices = candidates(args.nproc, args.per_rank)
    sections = []
    for name in args.models:
        model_fn, batch_fn = MODELS[name]
        predicted = []
        for choice in choices:
            trace = trace_step(model_fn, batch_fn, choice.micro_batch, None, choice.checkpointing, device="cpu")
            predicted.append(predict(trace, choice, StepClock(profile, choice)))
        measured = run_distributed(measure_all, args.nproc, name, choices, args.steps, timeout=1800)
        rows = []
        for index, (choice, plan) in enumerate(zip(choices, predicted)):
            peak = max(rank[index]["peak"] for rank in measured)
            seconds = max(rank[index]["seconds"] for rank in measured)
            cpu = max(rank[index]["cpu_seconds"] for rank in measured)
            rows.append((choice, plan, peak, seconds, cpu))
        predicted_times = [p.time.total for _, p, _, _, _ in rows]
        rho = spearman(predicted_times, [r[3] for r in rows])
        rho_cpu = spearman(predicted_times, [r[4] for r in rows])
        called, agreed = decisive_pairs(predicted_times, [r[4] for r in rows])
        limit = int(sorted(r[1].peak for r in rows)[len(rows) // 2] * 1.01)  # the median, 1% headroom
        fitting = [r for r in rows if r[1].peak <= limit]
        first = min(fitting, key=lambda r: r[1].time.total)
        lines = [
            f"### {name}, {args.nproc} gloo ranks, {args.per_rank} samples per rank and step",
            "",
            "| choice | peak predicted | peak measured | error | step predicted (ms) | step measured, wall (ms) "
            "| step measured, CPU (ms) |",
            "|---|---|---|---|---|---|---|",
        ]
        for choice, plan, peak, seconds, cpu in rows:
            lines.append(
                f"| {choice.label()} | {plan.peak:,} | {peak:,} | {plan.peak / peak - 1:+.2%} | "
                f"{plan.time.total * 1e3:.1f} | {seconds * 1e3:.1f} | {cpu * 1e3:.1f} |"
            )
        lines += [
            "",
            f"Spearman rank correlation of predicted and measured step times: **{rho:.2f}** (wall), "
            f"**{rho_cpu:.2f}** (CPU time of the slower rank); of the {called} pairs the plan calls more than 15% "
            f"apart, {agreed} are ordered the same by the CPU times. Memory limit {limit:,} B (the median "
            f"predicted peak + 1%): first choice {first[0].label()}, measured peak {first[2]:,} B: "
            f"{'fits' if first[2] <= limit else 'DOES NOT FIT'}.",
            "",
        ]
        print("\n".join(lines))
        sections.append("\n".join(lines))
    if args.write:
        header = (
            "\n## `fullshard plan` for models not ours: prediction against measurement (issue 37)\n\n"
            f"Command: `PYTHONPATH=. .venv/bin/python benchmarks/bench_plan_any_model.py --nproc {args.nproc} "
            f"--write`; {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
            f"{torch.__version__}, gloo, one thread per rank; profile calibrated on this machine "
            f"({profile.matmul_flops['float32'] / 1e9:.1f} GFLOP/s fp32 matmul, "
            f"{profile.memory_bandwidth / 1e9:.1f} GB/s copy, {profile.intra_node_bandwidth / 1e9:.2f} GB/s gloo).\n\n"
        )
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"), "a") as f:
            f.write(header + "\n".join(sections))


if __name__ == "__main__":
    main()
