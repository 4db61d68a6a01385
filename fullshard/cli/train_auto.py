"""``fullshard train --auto``: ``plan()`` picks the sharding of the embedded GPT before the ranks start; after the
run, the plan and the measurement side by side.

The search covers what ``fullshard train`` can run: the strategies (hybrid with
each shard size), mixed precision, CPU offload and the quantized all-gather, at
the run's per-rank batch (train has no micro-batches or checkpointing). On CPU
the step-time model uses this machine's calibration (a few seconds: see
``fullshard/plan/calibrate.py``); on CUDA the H100 profile unless ``--profile``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from typing import Any

import torch

from .._text import align, human_bytes
from ..models import Transformer
from ..models.transformer import next_token_loss
from ..plan.calibrate import calibrate
from ..plan.choice import Choice
from ..plan.playback import Prediction
from ..plan.profiles import load_profile
from ..plan.search import plan
from ..training import TrainConfig

__all__ = ["add_arguments", "choose", "compare"]

_DTYPE_FLAGS = {None: "none", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "int8"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--auto: fullshard plan picks the configuration")
    group.add_argument(
        "--auto",
        action="store_true",
        help="let fullshard plan choose strategy, shard size, mixed "
        "precision, offload and all-gather codes for --nproc ranks (refused with --auto: the plan chooses them)",
    )
    group.add_argument(
        "--memory-limit", type=float, metavar="GIB", help="--auto: per-rank memory to fit (default: the device's)"
    )
    group.add_argument(
        "--profile",
        metavar="NAME|JSON",
        help="--auto: device profile (default: h100 on CUDA, a calibration of this machine on CPU)",
    )


def choose(config: TrainConfig, nproc: int, device: str, args: argparse.Namespace) -> tuple[TrainConfig, Prediction]:
    """``config`` with the first choice of ``plan()`` for ``nproc`` ranks; prints the plan."""
    model_args = config.model_args()
    seq, vocab = model_args.max_seq_len, model_args.vocab_size

    def batch_fn(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(vocab, (n, seq))
        return ids, ids

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        return next_token_loss(model(batch[0]), batch[1])

    if args.profile:  # its speeds; the run's device decides what the kernels allocate
        profile = dataclasses.replace(load_profile(args.profile), device=device)
    else:
        profile = load_profile("h100") if device == "cuda" else calibrate(ranks=min(max(nproc, 2), 4))
    result = plan(
        lambda: Transformer(model_args),
        batch_fn,
        world_size=nproc,
        memory_limit_gib=args.memory_limit,
        global_batch=config.batch,
        ranks_per_node=nproc,
        profile=profile,
        loss_fn=loss_fn,
        micro_batches=[config.batch // nproc],
        checkpointing=(False,),
        reshard_to=False,
        mixed_precision=(None, torch.bfloat16) if device == "cuda" else (None,),
    )
    print(result.report(rows=8))
    best = result.best
    if best is None:
        raise ValueError("--auto: no configuration fits the memory limit (see the table above)")
    return _as_train_config(config, best.choice), best


def _as_train_config(config: TrainConfig, choice: Choice) -> TrainConfig:
    return dataclasses.replace(
        config,
        strategy=choice.strategy,
        shard_size=choice.shard_size if choice.strategy == "hybrid" else None,
        mixed_precision=_DTYPE_FLAGS[choice.mixed_precision],
        cpu_offload=choice.cpu_offload,
        all_gather_dtype=_DTYPE_FLAGS[choice.all_gather_dtype],
    )


def metrics_path(config: TrainConfig) -> tuple[TrainConfig, str]:
    """``config`` with a metrics file to read the measurement from (a temporary one if none)."""
    if config.metrics:
        return config, config.metrics
    path = os.path.join(tempfile.mkdtemp(prefix="fullshard-auto-"), "metrics.jsonl")
    return dataclasses.replace(config, metrics=path), path


def compare(prediction: Prediction, path: str) -> str:
    """The plan's peak and step time next to the run's (the median step, the first two left out)."""
    steps, summary = [], None
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if "summary" in record:
                summary = record["summary"]
            elif "step_time_s" in record:
                steps.append(record["step_time_s"])
    if summary is None or not steps:
        return "fullshard train --auto: no measurement to compare (the run stopped early)"
    timed = sorted(steps[2:] or steps)
    measured_time = timed[len(timed) // 2]
    measured_peak = max(summary["peak_memory"] or [0])
    rows = [
        ["", "plan", "measured", "plan / measured"],
        [
            "peak per rank",
            human_bytes(prediction.peak),
            human_bytes(measured_peak),
            f"{prediction.peak / measured_peak:.3f}" if measured_peak else "-",
        ],
        [
            "step time",
            f"{prediction.time.total * 1e3:.1f} ms",
            f"{measured_time * 1e3:.1f} ms",
            f"{prediction.time.total / measured_time:.2f}",
        ],
    ]
    return f"\nfullshard train --auto: {prediction.choice.label()}\n" + align(rows)
