"""What one ``fullshard train`` run does: the flags, parsed once by the launcher, read by every rank.

The launcher turns the flags into a ``TrainConfig`` and hands it to the ranks as
JSON (one argument), so every rank runs exactly the configuration the user
typed, validated once before any process starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass

import torch

from ..models import PRESETS, ModelArgs, get_preset
from .corpus import VOCAB_SIZE

__all__ = ["ALL_GATHER_DTYPES", "FRONT_ENDS", "MIXED_PRECISION", "STRATEGIES", "TrainConfig", "add_arguments"]

STRATEGIES = ("full", "grad-op", "no-shard", "hybrid")
# fully_shard: one fully_shard call per block and the root (FSDP2); wrapper: FullyShardedDataParallel
# with use_orig_params=False (FSDP1: one flat parameter per block and the root)
FRONT_ENDS = ("fully_shard", "wrapper")
MIXED_PRECISION = ("none", "bf16", "fp16")
# none: weights gathered in the compute dtype; else as block-wise codes of this dtype
_GATHER_CODES = {"none": None, "int8": torch.int8, "float8": torch.float8_e4m3fn}
ALL_GATHER_DTYPES = tuple(_GATHER_CODES)


@dataclass(frozen=True)
class TrainConfig:
    """One training run of a GPT preset on the embedded corpus.

    ``batch`` is the global number of sequences per step (split evenly over the
    ranks), so the loss curve does not depend on the world size.
    """

    model: str = "gpt-tiny"
    layers: int | None = None
    dim: int | None = None
    heads: int | None = None
    seq: int | None = None
    strategy: str = "full"
    front_end: str = "fully_shard"
    shard_size: int | None = None
    mixed_precision: str = "none"
    cpu_offload: bool = False
    all_gather_dtype: str = "none"
    steps: int = 200
    batch: int = 16
    lr: float = 3e-3
    warmup: int = 20
    clip: float = 1.0
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 50
    resume: bool = False
    metrics: str | None = None
    sample: int = 0
    threads: int | None = None
    debug: bool = False  # user mistakes show their traceback

    def model_args(self) -> ModelArgs:
        """The preset with the overrides and the corpus's byte vocabulary."""
        return get_preset(
            self.model,
            n_layers=self.layers,
            dim=self.dim,
            n_heads=self.heads,
            max_seq_len=self.seq,
            vocab_size=VOCAB_SIZE,
        )

    @property
    def all_gather_code(self) -> torch.dtype | None:
        """The code dtype of ``--all-gather-dtype`` (None: no quantized all-gather)."""
        return _GATHER_CODES[self.all_gather_dtype]

    @property
    def checkpoint_folder(self) -> str:
        """``checkpoint_dir``, for the steps that need one (``validate`` checks ``--resume``'s)."""
        if not self.checkpoint_dir:
            raise ValueError("saving or resuming needs --checkpoint-dir")
        return self.checkpoint_dir

    def problems(self) -> list[str]:
        """Every setting no rank could run, one line each naming the flag and its value."""
        found = []
        for flag, value, choices in (
            ("--model", self.model, PRESETS),
            ("--strategy", self.strategy, STRATEGIES),
            ("--front-end", self.front_end, FRONT_ENDS),
            ("--mixed-precision", self.mixed_precision, MIXED_PRECISION),
            ("--all-gather-dtype", self.all_gather_dtype, ALL_GATHER_DTYPES),
        ):
            if value not in choices:
                found.append(f"{flag} expects one of {', '.join(choices)} but got {value!r}")
        counts: tuple[tuple[str, int | None], ...] = (
            ("--steps", self.steps),
            ("--batch", self.batch),
            ("--checkpoint-every", self.checkpoint_every),
            ("--layers", self.layers),
            ("--dim", self.dim),
            ("--heads", self.heads),
            ("--seq", self.seq),
            ("--shard-size", self.shard_size),
            ("--threads", self.threads),
        )
        for flag, count in counts:
            if count is not None and count < 1:
                found.append(f"{flag} expects a positive number but got {count}")
        if not self.lr > 0:  # NaN too
            found.append(f"--lr expects a positive number but got {self.lr:g}")
        for flag, number in (("--warmup", self.warmup), ("--clip", self.clip), ("--sample", self.sample)):
            if not number >= 0:
                found.append(f"{flag} expects a number >= 0 but got {number:g}")
        if self.shard_size is not None and self.strategy != "hybrid":
            found.append(
                f"--shard-size {self.shard_size} applies only to --strategy hybrid, but got --strategy "
                f"{self.strategy}: add --strategy hybrid, or drop --shard-size"
            )
        if self.resume and not self.checkpoint_dir:
            found.append("--resume needs --checkpoint-dir (the folder to resume from)")
        if self.model in PRESETS and not any(
            value is not None and value < 1 for value in (self.layers, self.dim, self.heads, self.seq)
        ):
            args = self.model_args()
            if args.dim % args.n_heads:
                found.append(f"--dim {args.dim} must be divisible by --heads {args.n_heads}")
        return found

    def validate(self) -> None:
        """Raises ValueError naming every flag whose setting no rank could run (one line each)."""
        found = self.problems()
        if found:
            raise ValueError("\n".join(found))

    def world_problems(self, world_size: int, ranks_per_node: int) -> list[str]:
        """The settings that do not fit ``world_size`` ranks, ``ranks_per_node`` on each machine."""
        found = []
        if self.batch >= 1 and self.batch % world_size:
            found.append(
                f"--batch {self.batch} must be divisible by the number of ranks {world_size} (it is the "
                "global batch: sequences per step over all ranks)"
            )
        shard = self.shard_group_size(world_size, ranks_per_node)
        if self.strategy == "hybrid" and shard >= 1 and world_size % shard:
            found.append(f"--shard-size {shard} must divide the number of ranks {world_size}")
        return found

    def validate_world(self, world_size: int, ranks_per_node: int | None = None) -> None:
        """Raises ValueError for settings that do not fit ``world_size`` ranks."""
        found = self.world_problems(world_size, ranks_per_node or world_size)
        if found:
            raise ValueError("\n".join(found))

    def shard_group_size(self, world_size: int, ranks_per_node: int) -> int:
        """Ranks a parameter is split across: hybrid's shard group (``--shard-size``, else the
        ranks on one machine), every rank (full, grad-op) or none (no-shard)."""
        if self.strategy == "hybrid":
            return self.shard_size or ranks_per_node
        return 1 if self.strategy == "no-shard" else world_size

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        return cls(**json.loads(text))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainConfig:
        """The config from parsed flags (``add_arguments``), validated."""
        names = {field.name for field in dataclasses.fields(cls)}
        config = cls(**{name: value for name, value in vars(args).items() if name in names})
        config.validate()
        return config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The training flags, with ``TrainConfig``'s defaults."""
    defaults = TrainConfig()
    model = parser.add_argument_group("model (a preset, optionally changed; byte vocabulary)")
    model.add_argument("--model", choices=list(PRESETS), default=defaults.model)
    model.add_argument("--layers", type=int, help="number of transformer blocks")
    model.add_argument("--dim", type=int, help="model width")
    model.add_argument("--heads", type=int, help="attention heads")
    model.add_argument("--seq", type=int, help="tokens per sequence")
    sharding = parser.add_argument_group("sharding")
    sharding.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default=defaults.strategy,
        help="full (FULL_SHARD), grad-op (SHARD_GRAD_OP), no-shard (replicate), "
        "hybrid (shard within groups of --shard-size ranks, replicate across)",
    )
    sharding.add_argument(
        "--front-end",
        choices=FRONT_ENDS,
        default=defaults.front_end,
        help="fully_shard (FSDP2's API, a DTensor per parameter) or wrapper (FullyShardedDataParallel, FSDP1's "
        "API, one flat parameter per unit)",
    )
    sharding.add_argument(
        "--shard-size",
        type=int,
        help="with --strategy hybrid only: ranks per shard group (default: ranks per node, which on one machine "
        "is every rank, i.e. full sharding)",
    )
    sharding.add_argument(
        "--mixed-precision",
        choices=MIXED_PRECISION,
        default=defaults.mixed_precision,
        help="compute dtype; gradients are reduced in fp32 (fp16 adds a ShardedGradScaler)",
    )
    sharding.add_argument("--cpu-offload", action="store_true", help="shards, gradients and optimizer on the host")
    sharding.add_argument(
        "--all-gather-dtype",
        choices=ALL_GATHER_DTYPES,
        default=defaults.all_gather_dtype,
        help="gather weights as block-wise int8 or float8 codes (about half of bf16's bytes); "
        "norms and embeddings stay exact",
    )
    training = parser.add_argument_group("training")
    training.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps in total")
    training.add_argument(
        "--batch",
        type=int,
        default=defaults.batch,
        help="sequences per step over all ranks (the global batch, split evenly; fullshard plan's --batch "
        "means the same)",
    )
    training.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate (AdamW)")
    training.add_argument("--warmup", type=int, default=defaults.warmup, help="linear warm-up steps, then cosine")
    training.add_argument("--clip", type=float, default=defaults.clip, help="gradient norm clip (0: off)")
    training.add_argument("--seed", type=int, default=defaults.seed, help="initialisation and data order")
    training.add_argument("--threads", type=int, help="CPU threads per rank, at least 1 (default: cores / local ranks)")
    state = parser.add_argument_group("checkpoints and output")
    state.add_argument("--checkpoint-dir", help="save sharded checkpoints here (and on Ctrl-C)")
    state.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every, help="steps between saves")
    state.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    state.add_argument(
        "--metrics",
        help="append one JSON line per step (and a summary line) to this file; lines already there stay, "
        "except that --resume drops the interrupted run's lines past its checkpoint",
    )
    state.add_argument(
        "--sample",
        type=int,
        default=defaults.sample,
        metavar="BYTES",
        help="at the end, print this many bytes the model writes after a prompt",
    )
    state.add_argument("--debug", action="store_true", help="show the traceback of a user mistake (bad checkpoint)")
