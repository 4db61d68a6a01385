"""What the examples share: launching under torchrun, the training text, and
training a sharded model next to a one-process copy while printing both losses.

An example script defines ``parse_args`` (with the flags below) and
``train(args)``, and ends with ``side_by_side.main(__file__, parse_args, train)``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from tqdm import tqdm

# Lewis Carroll, "Alice's Adventures in Wonderland" (1865), public domain.
TEXT = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having "
    "nothing to do: once or twice she had peeped into the book her sister was reading, but it had "
    "no pictures or conversations in it, 'and what is the use of a book,' thought Alice 'without "
    "pictures or conversations?' So she was considering in her own mind (as well as she could, for "
    "the hot day made her feel very sleepy and stupid), whether the pleasure of making a "
    "daisy-chain would be worth the trouble of getting up and picking the daisies, when suddenly a "
    "White Rabbit with pink eyes ran close by her. There was nothing so very remarkable in that; "
    "nor did Alice think it so very much out of the way to hear the Rabbit say to itself, 'Oh "
    "dear! Oh dear! I shall be late!'"
)
VOCAB_SIZE = 256  # bytes

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def add_training_args(parser: argparse.ArgumentParser, steps: int = 40) -> None:
    """The flags every example takes (``train_side_by_side`` reads them)."""
    parser.add_argument("--nproc", type=int, default=2, help="ranks to launch (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=64)
    # Much higher and these tiny models hit loss spikes, which amplify the
    # (legitimate) float-rounding differences between the two runs.
    parser.add_argument("--lr", type=float, default=1e-3)


def main(script: str, parse_args: Callable, train: Callable) -> None:
    """Runs ``train`` on this rank under torchrun, else launches ``--nproc`` ranks of ``script``."""
    args = parse_args(sys.argv[1:])
    if "LOCAL_RANK" in os.environ:
        dist.init_process_group("gloo")
        try:
            world = dist.get_world_size()
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
            if args.batch % world:
                raise ValueError(f"--batch {args.batch} must be divisible by the number of ranks {world}")
            train(args)
        finally:
            dist.destroy_process_group()
    else:
        launch(script, args)


def launch(script: str, args: argparse.Namespace) -> None:
    """Starts ``args.nproc`` copies of ``script`` through torchrun's own launcher."""
    from torch.distributed.run import main as torchrun

    # Forward the training flags only: torchrun's parser would read --nproc as
    # an ambiguous prefix of its own options.
    forwarded = [f"--{name}={value}" for name, value in vars(args).items() if name != "nproc"]
    torchrun([
        "--standalone", "--nproc-per-node", str(args.nproc),  # torchrun picks a free port itself
        script, *forwarded,
    ])


def text_batches(batch: int, seq: int, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Random windows of TEXT as bytes: (tokens, next tokens), each ``(batch, seq)``."""
    data = torch.tensor(list(TEXT.encode()), dtype=torch.long)
    while True:
        starts = torch.randint(len(data) - seq - 1, (batch,), generator=generator)
        window = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def train_side_by_side(
    model: nn.Module, reference: nn.Module | None, loss_fn: LossFn, args: argparse.Namespace
) -> None:
    """Trains the sharded ``model`` on each rank's slice of every batch and, on
    rank 0, ``reference`` (an unsharded copy, ``None`` elsewhere) on the whole
    batch, with AdamW; rank 0 prints both losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=args.lr) if reference is not None else None
    data = text_batches(args.batch, args.seq, torch.Generator().manual_seed(1))
    rows = []
    progress = tqdm(range(args.steps), desc=f"fullshard x{world}", disable=rank != 0)
    start = time.perf_counter()
    for step in progress:
        tokens, targets = next(data)
        local = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
        loss = loss_fn(model, tokens[local], targets[local])
        loss.backward()
        optim.step()
        optim.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        if reference is not None:
            ref_loss = loss_fn(reference, tokens, targets)
            ref_loss.backward()
            ref_optim.step()
            ref_optim.zero_grad()
            rows.append((step, loss.item(), ref_loss.item()))
            progress.set_postfix(loss=f"{loss.item():.4f}", single=f"{ref_loss.item():.4f}")
    elapsed = time.perf_counter() - start
    if reference is not None:
        num_params = sum(p.numel() for p in reference.parameters())
        print_losses(rows, world, num_params, elapsed)


def print_losses(rows: list[tuple[int, float, float]], world: int, num_params: int, elapsed: float) -> None:
    print(f"\n{'step':>5}  {'fullshard x' + str(world):>14}  {'one process':>12}  {'|diff|':>9}")
    shown = rows[:: max(1, len(rows) // 10)]
    if shown[-1] is not rows[-1]:
        shown.append(rows[-1])
    for step, ours, single in shown:
        print(f"{step:>5}  {ours:>14.6f}  {single:>12.6f}  {abs(ours - single):>9.2e}")
    worst = max(abs(a - b) / max(abs(b), 1e-12) for _, a, b in rows)
    print(f"\n{num_params / 1e6:.2f}M parameters, {len(rows)} steps in {elapsed:.1f}s; "
          f"largest relative loss difference {worst:.1e}")
