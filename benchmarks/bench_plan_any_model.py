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
benchmarks/RESULTS.md. ``--codec`` prints only the plan's int8 codec times for the
block unit ``bench_quantize.py --unit`` measures (see [Note: Codec cost]).
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

from fullshard.models import ModelArgs, Transformer  # noqa: E402
from fullshard.plan import Choice  # noqa: E402
from fullshard.plan.calibrate import calibrate  # noqa: E402
from fullshard.plan.measure import ChoiceRun  # noqa: E402
from fullshard.plan.playback import predict  # noqa: E402
from fullshard.plan.profiles import DeviceProfile, load_profile  # noqa: E402
from fullshard.plan.step_time import StepClock, codec_work  # noqa: E402
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


def measure_all(name: str, choices: list[Choice], rounds: int, steps_per_round: int) -> dict:
    """On every rank: each choice's memory, then its CPU seconds per step in interleaved rounds (each
    round runs every choice ``steps_per_round`` times, starting one choice later than the round before),
    so that a change in the machine's load falls on every choice alike."""
    model_fn, batch_fn = MODELS[name]
    runs = [ChoiceRun(model_fn, batch_fn, choice) for choice in choices]
    peaks = [run.memory()[0] for run in runs]
    cpu: list[list[float]] = [[] for _ in choices]
    wall: list[list[float]] = [[] for _ in choices]
    for round_ in range(rounds):
        for offset in range(len(choices)):
            index = (round_ + offset) % len(choices)
            for _ in range(steps_per_round):
                seconds, cpu_seconds = runs[index].timed_step()
                wall[index].append(seconds)
                cpu[index].append(cpu_seconds)
    return {"peaks": peaks, "cpu": cpu, "wall": wall}


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def ranks(values: list[float]) -> list[float]:
    """Ranks from 0, equal values sharing the mean of their ranks."""
    order = sorted(range(len(values)), key=values.__getitem__)
    result = [0.0] * len(values)
    start = 0
    while start < len(order):
        stop = start
        while stop + 1 < len(order) and values[order[stop + 1]] == values[order[start]]:
            stop += 1
        for position in range(start, stop + 1):
            result[order[position]] = (start + stop) / 2
        start = stop + 1
    return result


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's of the ranks (ties share their mean rank)."""
    ra, rb = ranks(a), ranks(b)
    mean_a, mean_b = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - mean_a) * (y - mean_b) for x, y in zip(ra, rb))
    spread = (sum((x - mean_a) ** 2 for x in ra) * sum((y - mean_b) ** 2 for y in rb)) ** 0.5
    return cov / spread if spread else 0.0


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


def near_ties(predicted: list[float], margin: float) -> list[float]:
    """The predictions with each run of values less than ``margin`` apart (relative, neighbour to
    neighbour in sorted order) replaced by the run's first value: near-ties as ties."""
    order = sorted(range(len(predicted)), key=predicted.__getitem__)
    tied = list(predicted)
    anchor = predicted[order[0]]
    for previous, index in zip(order, order[1:]):
        if predicted[index] > (1 + margin) * predicted[previous]:
            anchor = predicted[index]
        tied[index] = anchor
    return tied


def slowest_rank(per_rank: list[list[float]]) -> list[float]:
    """Per step, the slowest rank's seconds (the ranks step in lockstep)."""
    return [max(step) for step in zip(*per_rank)]


def section(name: str, args: argparse.Namespace, profile: DeviceProfile) -> tuple[str, dict]:
    model_fn, batch_fn = MODELS[name]
    choices = candidates(args.nproc, args.per_rank)
    predicted = []
    for choice in choices:
        trace = trace_step(model_fn, batch_fn, choice.micro_batch, None, choice.checkpointing, device="cpu")
        predicted.append(predict(trace, choice, StepClock(profile, choice)))
    measured = run_distributed(measure_all, args.nproc, name, choices, args.rounds, args.steps_per_round, timeout=3600)
    steps = [slowest_rank([rank["cpu"][i] for rank in measured]) for i in range(len(choices))]
    walls = [slowest_rank([rank["wall"][i] for rank in measured]) for i in range(len(choices))]
    peaks = [max(rank["peaks"][i] for rank in measured) for i in range(len(choices))]
    cpu = [median(s) for s in steps]
    times = [p.time.total for p in predicted]
    # The rounds cut into ``--groups`` consecutive groups: each group's medians give one Spearman.
    per_group = len(steps[0]) // args.groups
    groups = [[median(s[g * per_group : (g + 1) * per_group]) for s in steps] for g in range(args.groups)]
    rhos = sorted(spearman(times, g) for g in groups)
    rho = spearman(times, cpu)
    rho_tied = spearman(near_ties(times, args.tie), cpu)
    called, agreed = decisive_pairs(times, cpu)
    limit = int(sorted(p.peak for p in predicted)[len(predicted) // 2] * 1.01)  # the median, 1% headroom
    first = min((i for i, p in enumerate(predicted) if p.peak <= limit), key=lambda i: times[i])
    lines = [
        f"### {name}, {args.nproc} gloo ranks, {args.per_rank} samples per rank and step",
        "",
        "| choice | peak predicted | peak measured | error | step predicted (ms) | CPU, slowest rank (ms) "
        "| its spread over groups | wall (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, (choice, plan) in enumerate(zip(choices, predicted)):
        medians = [g[i] for g in groups]
        lines.append(
            f"| {choice.label()} | {plan.peak:,} | {peaks[i]:,} | {plan.peak / peaks[i] - 1:+.2%} | "
            f"{times[i] * 1e3:.1f} | {cpu[i] * 1e3:.1f} | {min(medians) * 1e3:.1f}-{max(medians) * 1e3:.1f} | "
            f"{median(walls[i]) * 1e3:.1f} |"
        )
    lines += [
        "",
        f"Spearman of predicted and measured step times (CPU time of the slowest rank, median of "
        f"{len(steps[0])} steps): **{rho:.2f}**; per group of {per_group} steps: "
        f"{', '.join(f'{r:.2f}' for r in rhos)}; with the predictions less than {args.tie:.0%} apart as ties: "
        f"{rho_tied:.2f}. Of the {called} pairs the plan calls more than 15% apart, {agreed} are ordered the "
        f"same way. Memory limit {limit:,} B (the median predicted peak + 1%): first choice "
        f"{choices[first].label()}, measured peak {peaks[first]:,} B: "
        f"{'fits' if peaks[first] <= limit else 'DOES NOT FIT'}.",
        "",
    ]
    summary = {"rho": rho, "groups": rhos, "tied": rho_tied}
    return "\n".join(lines), summary


def codec_predictions(profile: DeviceProfile) -> str:
    """The plan's codec time (see [Note: Codec cost]) for the unit ``bench_quantize.py --unit`` times:
    one bench GPT block (dim 576, norms and biases exact), bf16 compute from fp32 shards, int8."""
    block = Transformer(ModelArgs(n_layers=1, vocab_size=256, max_seq_len=128, dim=576, n_heads=8)).layers[0]
    params = list(block.parameters())
    clock = StepClock(profile, Choice(2, device="cpu"))
    lines = ["| ranks | codec | encode predicted (ms) | decode predicted (ms) |", "|---|---|---|---|"]
    for world in (2, 4):
        rows = [-(-p.shape[0] // world) * (p.numel() // p.shape[0]) for p in params]
        coded = sum(n for n, p in zip(rows, params) if p.dim() >= 2)
        exact = (sum(rows) - coded) * 2
        for name, fused in (("eager", False), ("kernel (fused)", True)):
            encode, decode = codec_work(coded, exact, world, 4, 2, fused)
            ms = [clock.work_seconds(work) * 1e3 for work in (encode, decode)]
            lines.append(f"| {world} | {name} | {ms[0]:.2f} | {ms[1]:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--per-rank", type=int, default=8, help="samples per rank and step")
    parser.add_argument("--rounds", type=int, default=12, help="rounds over every candidate (interleaved)")
    parser.add_argument("--steps-per-round", type=int, default=1, help="steps of a candidate per round")
    parser.add_argument("--groups", type=int, default=3, help="consecutive groups of rounds, one Spearman each")
    parser.add_argument("--tie", type=float, default=0.03, help="predictions closer than this are near-ties")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--profile", help="a profile JSON (default: calibrate this machine first)")
    parser.add_argument("--write", action="store_true", help="append to benchmarks/RESULTS.md")
    parser.add_argument(
        "--codec", action="store_true", help="only the codec's predicted times, for bench_quantize.py --unit's"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    profile = load_profile(args.profile) if args.profile else calibrate(ranks=args.nproc)
    print(
        f"profile: {profile.name}: {profile.matmul_flops['float32'] / 1e9:.1f} GFLOP/s fp32, memory "
        f"{profile.memory_bandwidth / 1e9:.1f} GB/s, op {profile.op_overhead * 1e6:.1f} us"
    )
    if args.codec:
        print(codec_predictions(profile))
        return
    sections, summaries = [], {}
    for name in args.models:
        text, summaries[name] = section(name, args, profile)
        print(text, flush=True)
        sections.append(text)
    print(
        "summary: "
        + "; ".join(
            f"{name} {s['rho']:.2f} (groups {min(s['groups']):.2f}-{max(s['groups']):.2f}, ties {s['tied']:.2f})"
            for name, s in summaries.items()
        )
    )
    if args.write:
        header = (
            f"\nCommand: `PYTHONPATH=. .venv/bin/python benchmarks/bench_plan_any_model.py --nproc {args.nproc} "
            f"--per-rank {args.per_rank} --rounds {args.rounds}`; {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores, torch {torch.__version__}, gloo, one thread per rank; profile: "
            f"{profile.name} ({profile.matmul_flops['float32'] / 1e9:.1f} GFLOP/s fp32 matmul, "
            f"{profile.memory_bandwidth / 1e9:.1f} GB/s copy, {profile.op_overhead * 1e6:.1f} us per operator).\n\n"
        )
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"), "a") as f:
            f.write(header + "\n".join(sections))


if __name__ == "__main__":
    main()
