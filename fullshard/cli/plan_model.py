"""``fullshard plan --module`` / ``--hf-config`` / ``--calibrate``: the search for a user's own model.

    fullshard plan --module mypkg.models:build --world-size 64 --batch 512 --memory-limit 80
    fullshard plan --hf-config ./llama-config.json --seq 4096 --world-size 64 --batch 256 --profile h100
    fullshard plan --calibrate my-machine.json      # measure this machine, then --profile my-machine.json

``--module pkg.mod:factory`` names a function that returns the model (called
under fake tensors: its parameters take no memory); the batch comes from
``--batch-fn pkg.mod:fn`` (``fn(n)`` -> ``n`` samples) or the module's
``example_batch``. ``--hf-config`` takes a local transformers config (a
directory with ``config.json``, or a JSON file) and builds the causal LM
from it with no weights; the batch is ``--seq`` random token ids with the
labels that give the model's own loss.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.nn as nn

from ..plan.calibrate import calibrate
from ..plan.profiles import PROFILES, load_profile
from ..plan.search import ModelPlan, plan
from .flags import only_with, set_flags
from .paths import file_problems

__all__ = ["add_arguments", "model_problems", "run_model_search", "wants_model_search"]

_ROWS = 12
_PROFILE = "h100"
# The preset's flags, which a search for the user's own model does not read; and the plan's, which it does.
_PRESET_ONLY = [
    "model",
    "layers",
    "dim",
    "heads",
    "vocab",
    "mixed_precision",
    "cpu_offload",
    "all_gather_dtype",
    "flat_params",
    "device",
]
_PLAN_ONLY = ["world_size", "strategy", "ranks_per_node", "batch", "batch_per_rank", "memory_limit", "plot"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("your own model: search the configuration that fits and runs fastest")
    group.add_argument("--module", metavar="PKG.MOD:FACTORY", help="a function that returns your nn.Module")
    group.add_argument(
        "--batch-fn", metavar="PKG.MOD:FN", help="fn(n) -> a batch of n samples (default: the --module's example_batch)"
    )
    group.add_argument("--hf-config", metavar="PATH", help="a local transformers config (folder or JSON file)")
    group.add_argument(
        "--profile",
        metavar="NAME|JSON",
        help=f"device profile: {', '.join(PROFILES)} or a --calibrate file (default h100; with --calibrate, the "
        "profile whose figures the measurement does not replace)",
    )
    group.add_argument(
        "--micro-batch",
        type=int,
        nargs="+",
        metavar="N",
        help="micro-batch sizes to try (default: every divisor of the per-rank batch)",
    )
    group.add_argument("--rows", type=int, metavar="N", help=f"rows of the table (default {_ROWS})")
    group.add_argument(
        "--calibrate",
        metavar="PATH",
        help="measure this machine's matmuls, memory, per-operator overhead and "
        "(on CPU) gloo collectives in a few seconds, and save a profile to PATH",
    )


def wants_model_search(args: argparse.Namespace) -> bool:
    return bool(args.module or args.hf_config or args.calibrate)


def model_problems(args: argparse.Namespace) -> list[str]:
    """The search's flags: every one that is wrong, or that does nothing in this combination."""
    found = []
    searching = bool(args.module or args.hf_config)
    idle = set_flags(args, ["batch_fn", "micro_batch", "rows"] + ([] if args.calibrate else ["profile"]))
    if idle and not searching:
        found.append(only_with(idle, "to the search for your own model", "add --module or --hf-config"))
    preset_only = set_flags(args, _PRESET_ONLY + ([] if args.hf_config else ["seq"]))
    if preset_only and searching:
        found.append(
            only_with(
                preset_only,
                "to the GPT presets (--model), not to --module/--hf-config (the search tries precision, offload and "
                "the all-gather itself; --profile sets the device)",
                "plan a preset without --module/--hf-config",
            )
        )
    if args.calibrate and not searching:
        unused = set_flags(args, _PRESET_ONLY + _PLAN_ONLY + ["seq"])
        if unused:
            found.append(
                only_with(unused, "to a plan, and --calibrate alone only measures", "add --module or --hf-config")
            )
    sizes = [s for group in args.world_size or [] for s in group]
    if searching and args.batch is not None and args.batch >= 1 and len(sizes) == 1 and args.batch % sizes[0]:
        found.append(f"--batch {args.batch} must be divisible by --world-size {sizes[0]} (it is the global batch)")
    if args.batch_fn and args.hf_config:
        found.append("--batch-fn applies only to --module (--hf-config makes its own batch of token ids)")
    if args.calibrate:
        found += file_problems("--calibrate", args.calibrate)
    if args.module and args.hf_config:
        found.append("--module and --hf-config: pass one of them")
    if args.module and ":" not in args.module:
        found.append(f"--module expects PKG.MOD:FACTORY but got {args.module!r}")
    if args.hf_config and not os.path.exists(args.hf_config):
        found.append(
            f"--hf-config {args.hf_config}: no such local file or folder (there is no internet here to fetch a hub "
            "name: pass a folder with config.json, or a JSON file)"
        )
    elif (
        args.hf_config
        and os.path.isdir(args.hf_config)
        and not os.path.isfile(os.path.join(args.hf_config, "config.json"))
    ):
        found.append(f"--hf-config {args.hf_config}: the folder has no config.json")
    sizes = [s for group in args.world_size or [] for s in group]
    if (args.module or args.hf_config) and len(sizes) > 1:
        found.append(f"--world-size expects one value with --module/--hf-config but got {sizes}")
    if args.rows is not None and args.rows < 1:
        found.append(f"--rows expects a positive number but got {args.rows}")
    for size in args.micro_batch or []:
        if size < 1:
            found.append(f"--micro-batch expects positive numbers but got {size}")
    if args.profile is not None and args.profile.lower() not in PROFILES and not os.path.isfile(args.profile):
        found.append(f"--profile expects one of {', '.join(PROFILES)} or a profile JSON file but got {args.profile!r}")
    return found


def _load(spec: str, flag: str) -> Callable[..., Any]:
    module_name, _, attribute = spec.partition(":")
    try:
        module: ModuleType = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{flag} {spec}: cannot import {module_name} ({exc})") from None
    except Exception as exc:  # the user's module failed while it ran: its own error, in one line
        raise ValueError(f"{flag} {spec}: importing {module_name} raised {_one_line(exc)}") from exc
    found = getattr(module, attribute, None)
    if not callable(found):
        raise ValueError(f"{flag} {spec}: {module_name} has no function {attribute}")
    return found


def _module_model(args: argparse.Namespace) -> tuple[Callable[[], nn.Module], Callable[[int], Any]]:
    factory = _load(args.module, "--module")
    if args.batch_fn:
        return factory, _load(args.batch_fn, "--batch-fn")
    module_name = args.module.partition(":")[0]
    batch_fn = getattr(importlib.import_module(module_name), "example_batch", None)
    if not callable(batch_fn):
        raise ValueError(
            f"--module {args.module}: pass --batch-fn PKG.MOD:FN, or define example_batch(n) in {module_name}"
        )
    return factory, batch_fn


def hf_model(path: str, seq: int | None) -> tuple[Callable[[], nn.Module], Callable[[int], Any]]:
    """A causal LM from a local config, no weights, and a batch of ``seq`` tokens with labels."""
    try:
        import transformers
    except ImportError:
        raise ValueError("--hf-config needs transformers: pip install transformers") from None
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--hf-config {path}: not a transformers config ({str(exc).splitlines()[0]})") from None
    length = seq or min(getattr(config, "max_position_embeddings", 1024) or 1024, 2048)
    vocab = config.vocab_size

    def model_fn() -> nn.Module:
        return transformers.AutoModelForCausalLM.from_config(config)

    def batch_fn(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(vocab, (n, length))
        return {"input_ids": ids, "labels": ids}

    return model_fn, batch_fn


def run_model_search(args: argparse.Namespace) -> int:
    if args.calibrate:
        profile = calibrate(base=args.profile if args.profile and args.profile.lower() in PROFILES else _PROFILE)
        with open(args.calibrate, "w") as f:
            f.write(profile.to_json())
        print(profile.to_json())
        print(f"wrote {args.calibrate}: use it with --profile {args.calibrate}")
        if not (args.module or args.hf_config):
            return 0
    if args.module:
        model_fn, batch_fn = _module_model(args)
    else:
        model_fn, batch_fn = hf_model(args.hf_config, args.seq)
    world = (args.world_size or [[8]])[0][0]
    space: dict[str, Any] = {}
    if args.strategy and "all" not in args.strategy:
        space["strategies"] = args.strategy
    if args.micro_batch:
        space["micro_batches"] = args.micro_batch
    result = _search(args, model_fn, batch_fn, world, space)
    print(describe(result, world, args))
    print(result.report(args.rows or _ROWS))
    if args.plot:
        frontier_plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0 if result.best is not None else 1


def _search(
    args: argparse.Namespace,
    model_fn: Callable[[], nn.Module],
    batch_fn: Callable[[int], Any],
    world: int,
    space: dict[str, Any],
) -> ModelPlan:
    """``plan()`` on the user's model; any failure (their factory's, or plan's ValueError, whose words
    name its arguments) becomes one ValueError naming the flag (``--debug``: the original)."""
    try:
        return plan(
            model_fn,
            batch_fn,
            world_size=world,
            memory_limit_gib=args.memory_limit,
            global_batch=args.batch if args.batch is not None else world * (args.batch_per_rank or 1),
            ranks_per_node=args.ranks_per_node or 8,
            profile=load_profile(args.profile or _PROFILE),
            **space,
        )
    except Exception as exc:
        if args.debug:
            raise
        raise ValueError(f"{_what(args)}: {exc if isinstance(exc, ValueError) else _one_line(exc)}") from exc


def _what(args: argparse.Namespace) -> str:
    return f"--module {args.module}" if args.module else f"--hf-config {args.hf_config}"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def describe(result: ModelPlan, world: int, args: argparse.Namespace) -> str:
    what = args.module or args.hf_config
    blocks = len(result.block_names)
    units = f"{blocks} blocks ({result.block_names[0]} ...)" if blocks else "one unit (no repeated blocks found)"
    return (
        f"{what}: {result.num_params / 1e6:,.1f}M parameters, {units}\n"
        f"{world} ranks of {result.profile.name}, {args.ranks_per_node or 8} per node; "
        f"{len(result.predictions)} choices predicted\n"
    )


def frontier_plot(result: ModelPlan, path: str) -> None:
    """Every choice as peak memory against step time; the frontier (nothing both smaller and faster) joined."""
    from .plan import load_pyplot

    pyplot = load_pyplot()
    figure, axes = pyplot.subplots(figsize=(8, 5))
    points = [(p.time.total, p.peak / 2**30) for p in result.predictions]
    axes.scatter(*zip(*points), s=8, alpha=0.4, label="choices")
    frontier, least = [], float("inf")
    for seconds, gib in sorted(points):
        if gib < least:
            frontier.append((seconds, gib))
            least = gib
    axes.plot(*zip(*frontier), color="C1", marker="o", markersize=3, label="frontier")
    if result.memory_limit is not None:
        axes.axhline(result.memory_limit / 2**30, color="gray", linestyle="--", label="memory limit")
    axes.set_xscale("log")
    axes.set_xlabel("predicted step time (s)")
    axes.set_ylabel("predicted peak memory per rank (GiB)")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.savefig(path, dpi=120, bbox_inches="tight")
    pyplot.close(figure)
