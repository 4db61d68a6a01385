"""Train a small GPT on N CPU ranks with ``fully_shard`` next to a one-process run.

    python examples/train_transformer.py --nproc 2             # launches torchrun itself
    torchrun --nproc-per-node 2 examples/train_transformer.py  # the same, by hand

Every rank trains its slice of each batch with one unit per transformer block;
rank 0 also trains an unsharded copy on the whole batch in one process. The
two loss curves must agree (up to float rounding): that is what FSDP promises.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from fullshard import fully_shard
from fullshard.models import ModelArgs, Transformer

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


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="ranks to launch (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    # Much higher and this tiny model hits loss spikes, which amplify the
    # (legitimate) float-rounding differences between the two runs.
    parser.add_argument("--lr", type=float, default=1e-3)
    return parser.parse_args(argv)


def launch(args: argparse.Namespace) -> None:
    """Starts ``args.nproc`` copies of this script through torchrun's own launcher."""
    from torch.distributed.run import main as torchrun

    from fullshard.testing.harness import free_port

    # Forward the training flags only: torchrun's parser would read --nproc as
    # an ambiguous prefix of its own options.
    forwarded = [
        f"--{name}={value}" for name, value in vars(args).items() if name != "nproc"
    ]
    torchrun([
        "--nproc-per-node", str(args.nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        __file__, *forwarded,
    ])


def batches(args: argparse.Namespace, generator: torch.Generator):
    data = torch.tensor(list(TEXT.encode()), dtype=torch.long)
    while True:
        starts = torch.randint(len(data) - args.seq - 1, (args.batch,), generator=generator)
        window = torch.stack([data[s : s + args.seq + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def train(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if args.batch % world:
        raise ValueError(f"--batch {args.batch} must be divisible by the number of ranks {world}")
    torch.manual_seed(0)
    model_args = ModelArgs(n_layers=args.layers, vocab_size=256, max_seq_len=args.seq, dim=args.dim, n_heads=4)
    model = Transformer(model_args)
    reference = copy.deepcopy(model) if rank == 0 else None
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=args.lr) if reference else None

    data = batches(args, torch.Generator().manual_seed(1))
    rows = []
    progress = tqdm(range(args.steps), desc=f"fullshard x{world}", disable=rank != 0)
    start = time.perf_counter()
    for step in progress:
        tokens, targets = next(data)
        local = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
        loss = model.loss(tokens[local], targets[local])
        loss.backward()
        optim.step()
        optim.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        if reference is not None:
            ref_loss = reference.loss(tokens, targets)
            ref_loss.backward()
            ref_optim.step()
            ref_optim.zero_grad()
            rows.append((step, loss.item(), ref_loss.item()))
            progress.set_postfix(loss=f"{loss.item():.4f}", single=f"{ref_loss.item():.4f}")
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(f"\n{'step':>5}  {'fullshard x' + str(world):>14}  {'one process':>12}  {'|diff|':>9}")
        for step, ours, single in rows[:: max(1, len(rows) // 10)] + rows[-1:]:
            print(f"{step:>5}  {ours:>14.6f}  {single:>12.6f}  {abs(ours - single):>9.2e}")
        worst = max(abs(a - b) / max(abs(b), 1e-12) for _, a, b in rows)
        params = sum(p.numel() for p in reference.parameters())
        print(f"\n{params / 1e6:.2f}M parameters, {args.steps} steps in {elapsed:.1f}s; "
              f"largest relative loss difference {worst:.1e}")
    dist.destroy_process_group()


def main() -> None:
    args = parse_args(sys.argv[1:])
    if "LOCAL_RANK" in os.environ:
        train(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
