"""``fullshard plan``: per-rank memory and bytes per step of training a model, before running it.

    fullshard plan --model gpt-7b --world-size 8 64 1024 --mixed-precision bf16
    fullshard plan --model gpt-7b --world-size 1-16384 --strategy all --plot plan.png --memory-limit 80
    fullshard plan --model gpt-30m --world-size 1 2 4 --batch-per-rank 2 --device cpu
    fullshard plan --model gpt-tiny --world-size 2 --batch 16 --device cpu   # what fullshard train predicts
    fullshard plan --model gpt-125m --world-size 64 1024 --flat-params
    fullshard plan --model gpt-125m --layers 6 --seq 512 --world-size 16 --strategy hybrid --ranks-per-node 8

For each strategy and world size: this rank's sharded parameters, gradients
and optimizer states (AdamW), the largest gathered unit (one transformer block,
or the root: embeddings, final norm, tied head), the activations forward saves
for backward, the peak of one training step, and the bytes its collectives move
(full buffers, as fullshard counts them). A single configuration also gets the
breakdown of its peak, whose "activations and their grads" are what is alive
then (saved activations not yet freed, and the gradients backward computes).

``--batch`` is the global batch, sequences per step over all ranks, as in
``fullshard train`` (each world size gets its share; one that does not divide it
is skipped); ``--batch-per-rank`` gives each rank that many at every world size.
Until issue 39, plan's ``--batch`` meant per rank: that is now ``--batch-per-rank``
(the default, 1). The root unit is gathered once a step, as the engine keeps
its parameters from forward to backward.

Numbers come from ``fullshard.plan.estimate`` (arithmetic, no processes
started); see [Note: Plan model] in fullshard/plan/replay.py for what is and is
not counted. Every invalid flag is reported at once, one line each naming it;
``--debug`` shows the traceback of a failure to write ``--plot``.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import ModuleType

import torch

from .._text import align, describe_model, human_bytes
from ..models import PRESETS, ModelArgs, get_preset
from ..plan import STRATEGIES, Plan, PlanConfig, estimate
from . import plan_model
from .paths import file_problems

HELP = "predict per-rank memory and bytes per step for a model, world sizes and strategies"

_MIXED_PRECISION = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_GATHER_CODES = {"none": None, "int8": torch.int8, "float8": torch.float8_e4m3fn}
_PLOT_WORLD_SIZES = "1-16384"
_RANKS_PER_NODE = 8


def world_sizes(text: str) -> list[int]:
    """``"64"`` -> [64]; ``"1-1024"`` -> powers of two from 1 to 1024 (``"8-100"``: 8, 16, 32, 64, 100)."""
    low, _, high = text.partition("-")
    try:
        first, last = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a world size N or a range A-B but got {text!r}") from None
    if not 1 <= first <= last:
        raise argparse.ArgumentTypeError(f"expects 1 <= A <= B but got {text!r}")
    sizes = [first]
    while sizes[-1] * 2 <= last:
        sizes.append(sizes[-1] * 2)
    return sizes if sizes[-1] == last else sizes + [last]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (a preset, optionally changed)")
    model.add_argument("--model", choices=list(PRESETS), default="gpt-tiny")
    model.add_argument("--layers", type=int, help="number of transformer blocks")
    model.add_argument("--dim", type=int, help="model width")
    model.add_argument("--heads", type=int, help="attention heads")
    model.add_argument("--vocab", type=int, help="vocabulary size")
    model.add_argument("--seq", type=int, help="sequence length (max_seq_len, and the tokens per sequence)")
    setup = parser.add_argument_group("training setup")
    setup.add_argument(
        "--world-size",
        type=world_sizes,
        nargs="+",
        metavar="N|A-B",
        help=f"ranks: values and/or power-of-two ranges (default 8; with --plot {_PLOT_WORLD_SIZES})",
    )
    setup.add_argument(
        "--strategy",
        nargs="+",
        choices=[*STRATEGIES, "all"],
        default=None,
        help="full (FULL_SHARD), grad-op (SHARD_GRAD_OP), no-shard (replicate), hybrid; default full (all with --plot)",
    )
    setup.add_argument(
        "--ranks-per-node", type=int, help=f"hybrid only: shard within groups of this size (default {_RANKS_PER_NODE})"
    )
    batch = setup.add_mutually_exclusive_group()
    batch.add_argument(
        "--batch",
        type=int,
        help="sequences per step over all ranks, as fullshard train's --batch (split evenly; world sizes it "
        "does not divide are skipped)",
    )
    batch.add_argument("--batch-per-rank", type=int, help="sequences per rank and step (default 1)")
    setup.add_argument(
        "--mixed-precision",
        choices=list(_MIXED_PRECISION),
        default="none",
        help="compute (and all-gather) dtype; gradients are reduced in fp32",
    )
    setup.add_argument("--cpu-offload", action="store_true", help="shards, gradients and optimizer states on the host")
    setup.add_argument(
        "--all-gather-dtype",
        choices=list(_GATHER_CODES),
        default="none",
        help="weights gathered as block-wise codes (set_all_gather_quantization; norms and embeddings exact)",
    )
    setup.add_argument(
        "--flat-params",
        action="store_true",
        help="the FSDP1 wrapper with use_orig_params=False: each unit one flat parameter, ceil(numel/world) per rank",
    )
    setup.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="where the step runs: some kernels' temporaries differ (AdamW, gradient padding)",
    )
    output = parser.add_argument_group("output")
    output.add_argument("--memory-limit", type=float, metavar="GIB", help="device memory: mark what fits")
    output.add_argument(
        "--plot",
        metavar="PATH",
        help="draw peak memory against world size per strategy (needs matplotlib: pip install 'fullshard[plot]')",
    )
    output.add_argument("--debug", action="store_true", help="show the traceback of an error")
    plan_model.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    errors = problems(args)
    if errors:
        for line in errors:
            print(f"fullshard plan: {line}", file=sys.stderr)
        return 2
    pyplot = load_pyplot() if args.plot else None  # before any work: a missing extra fails at once
    if plan_model.wants_model_search(args):
        try:
            return plan_model.run_model_search(args)
        except ValueError as exc:
            if args.debug:
                raise
            print(f"fullshard plan: {exc}", file=sys.stderr)
            return 2
    model = get_preset(
        args.model,
        n_layers=args.layers,
        dim=args.dim,
        n_heads=args.heads,
        vocab_size=args.vocab,
        max_seq_len=args.seq,
    )
    plans, notes = build_plans(args, model)
    for note in notes:
        print(f"({note})")
    if not plans:
        print("fullshard plan: nothing to estimate (see the notes above)", file=sys.stderr)
        return 2
    print(describe_setup(args, plans))
    print(format_table(plans, args.memory_limit))
    if len(plans) == 1:
        print(format_breakdown(plans[0]))
    if pyplot is not None:
        try:
            plot(pyplot, plans, args.plot, args.memory_limit, title=f"{args.model}: {describe_model(model)}")
        except (OSError, ValueError) as exc:  # a folder that vanished, a full disk
            if args.debug:
                raise
            print(f"fullshard plan: --plot {args.plot}: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.plot}")
    return 0


def problems(args: argparse.Namespace) -> list[str]:
    """Every flag no plan can be made from, one line each naming the flag and its value."""
    found = []
    for flag in ("layers", "dim", "heads", "vocab", "seq", "ranks_per_node", "batch", "batch_per_rank"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            found.append(f"--{flag.replace('_', '-')} expects a positive number but got {value}")
    if args.memory_limit is not None and not args.memory_limit > 0:
        found.append(f"--memory-limit expects a positive number of GiB but got {args.memory_limit:g}")
    if not any(f.startswith(("--dim", "--heads")) for f in found):
        model = get_preset(args.model, dim=args.dim, n_heads=args.heads)
        if model.dim % model.n_heads:
            found.append(f"--dim {model.dim} must be divisible by --heads {model.n_heads}")
    if args.plot:
        found += _plot_path_problems(args.plot)
    found += plan_model.model_problems(args)
    if plan_model.wants_model_search(args):
        return found
    strategies = _strategies(args)
    if args.ranks_per_node is not None and "hybrid" not in strategies:
        found.append(
            f"--ranks-per-node {args.ranks_per_node} applies only to --strategy hybrid (or all), but got "
            f"--strategy {' '.join(strategies)}: add hybrid, or drop --ranks-per-node"
        )
    return found


def _plot_path_problems(path: str) -> list[str]:
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if suffix not in _PLOT_FORMATS and not os.path.isdir(path):
        return [f"--plot {path}: expects a file name ending in one of .{', .'.join(_PLOT_FORMATS)}"]
    return file_problems("--plot", path)


def _strategies(args: argparse.Namespace) -> list[str]:
    strategies = args.strategy or (["all"] if args.plot else ["full"])
    return list(STRATEGIES) if "all" in strategies else list(dict.fromkeys(strategies))


def build_plans(args: argparse.Namespace, model: ModelArgs) -> tuple[list[Plan], list[str]]:
    """A plan per (strategy, world size), and notes on the sizes skipped or the labels' meaning."""
    sizes = sorted(
        {size for group in args.world_size or [world_sizes(_PLOT_WORLD_SIZES if args.plot else "8")] for size in group}
    )
    compute = _MIXED_PRECISION[args.mixed_precision]
    ranks_per_node = args.ranks_per_node or _RANKS_PER_NODE
    plans: list[Plan] = []
    hybrid_skips, batch_skips = [], []
    for strategy in _strategies(args):
        for size in sizes:
            if strategy == "hybrid" and size % min(ranks_per_node, size):
                hybrid_skips.append(size)
                continue
            if args.batch is not None and args.batch % size:
                batch_skips.append(size)
                continue
            config = PlanConfig(
                model,
                size,
                strategy,
                ranks_per_node=ranks_per_node,
                batch_size=args.batch // size if args.batch is not None else args.batch_per_rank or 1,
                param_dtype=compute,
                reduce_dtype=torch.float32 if compute else None,
                cpu_offload=args.cpu_offload,
                all_gather_dtype=_GATHER_CODES[args.all_gather_dtype],
                flat_params=args.flat_params,
                device=args.device,
            )
            plans.append(estimate(config))
    notes = []
    if hybrid_skips:
        notes.append(
            f"hybrid skips world sizes that are not multiples of {ranks_per_node}: {', '.join(map(str, hybrid_skips))}"
        )
    if batch_skips:
        skips = ", ".join(map(str, dict.fromkeys(batch_skips)))
        notes.append(f"--batch {args.batch} (over all ranks) skips world sizes it does not divide: {skips}")
    return plans, notes + _label_notes(args, plans)


def _label_notes(args: argparse.Namespace, plans: list[Plan]) -> list[str]:
    """What a row's label does not say: hybrid with one shard group is full sharding; a quantized
    all-gather does nothing where no all-gather runs."""
    notes = []
    hybrid = [p.config for p in plans if p.config.strategy == "hybrid"]
    alone = sorted({c.world_size for c in hybrid if c.replicate_size == 1 and c.world_size > 1})
    if alone:
        notes.append(
            f"hybrid at world size {', '.join(map(str, alone))}: one shard group of every rank, no replicas: "
            "the same as full"
        )
    if args.all_gather_dtype != "none":
        idle = sorted({(p.config.strategy, p.config.world_size) for p in plans if p.config.shard_size == 1})
        if idle:
            where = ", ".join(f"{strategy} at {size}" for strategy, size in idle)
            notes.append(f"--all-gather-dtype {args.all_gather_dtype} has no effect where no all-gather runs: {where}")
    return notes


def describe_setup(args: argparse.Namespace, plans: list[Plan]) -> str:
    config = plans[0].config
    precision = "fp32 compute" if config.param_dtype is None else f"{args.mixed_precision} compute, fp32 reduce"
    offload = ", CPU offload" if config.cpu_offload else ""
    if config.all_gather_dtype is not None and any(p.config.shard_size > 1 for p in plans):
        offload += f", weights gathered as {args.all_gather_dtype}"
    if config.flat_params:
        offload += ", flat parameters (use_orig_params=False)"
    tokens = config.tokens_per_sequence
    if args.batch is not None:
        shares = ", ".join(f"{p.config.batch_size} at {p.config.world_size}" for p in _one_per_size(plans))
        batch = f"{args.batch} x {tokens} tokens per step over all ranks (sequences per rank: {shares})"
    else:
        batch = f"{config.batch_size} x {tokens} tokens per rank"
    return (
        f"{args.model}: {describe_model(config.model)}\n"
        f"{batch}; fp32 parameters and AdamW states, {precision}{offload}; step on {config.device}\n"
    )


def _one_per_size(plans: list[Plan]) -> list[Plan]:
    return list({p.config.world_size: p for p in plans}.values())


def format_table(plans: list[Plan], memory_limit: float | None) -> str:
    header = [
        "strategy",
        "world",
        "params",
        "grads",
        "optim",
        "largest unit",
        "saved activations",
        "peak/rank",
        "comm/step",
    ]
    rows = []
    for plan in plans:
        row = [plan.config.strategy, str(plan.config.world_size)] + [
            human_bytes(n)
            for n in (
                plan.params,
                plan.grads,
                plan.optimizer_states,
                plan.largest_unit,
                plan.activations,
                plan.peak,
                plan.comm_bytes,
            )
        ]
        if memory_limit is not None:
            row.append("yes" if plan.peak <= memory_limit * 2**30 else "no")
        rows.append(row)
    if memory_limit is not None:
        header.append(f"fits {memory_limit:g} GiB")
    return align([header, *rows])


def format_breakdown(plan: Plan) -> str:
    lines = [f"\npeak {human_bytes(plan.peak)} per rank, during {plan.peak_phase}:"]
    for category, nbytes in sorted(plan.peak_breakdown.items(), key=lambda item: -item[1]):
        lines.append(f"  {category:<28}{human_bytes(nbytes):>12}")
    if plan.host:
        lines.append(f"host memory (CPU offload): {human_bytes(plan.host)}")
    collectives = ", ".join(f"{op} {plan.comm_calls[op]} x = {human_bytes(nbytes)}" for op, nbytes in plan.comm.items())
    lines.append(f"collectives per step: {collectives or 'none'}")
    return "\n".join(lines)


# What matplotlib's Agg canvas writes (FigureCanvasBase.filetypes), without importing it for the check.
_PLOT_FORMATS = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp", "raw", "rgba", "pgf")


def load_pyplot() -> ModuleType:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        from matplotlib import pyplot
    except ImportError:
        raise SystemExit("fullshard plan --plot needs matplotlib: pip install 'fullshard[plot]'") from None
    return pyplot


def plot(pyplot: ModuleType, plans: list[Plan], path: str, memory_limit: float | None, title: str) -> None:
    """Peak memory per rank against world size (log scales), one line per strategy."""
    figure, axes = pyplot.subplots(figsize=(8, 5))
    for strategy in dict.fromkeys(p.config.strategy for p in plans):
        points = [(p.config.world_size, p.peak / 2**30) for p in plans if p.config.strategy == strategy]
        axes.plot(*zip(*points), marker="o", markersize=3, label=strategy)
    if memory_limit is not None:
        axes.axhline(memory_limit, color="gray", linestyle="--", label=f"{memory_limit:g} GiB device")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("world size (ranks)")
    axes.set_ylabel("peak memory per rank (GiB)")
    axes.set_title(title, fontsize=9)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.savefig(path, dpi=120, bbox_inches="tight")
    pyplot.close(figure)
