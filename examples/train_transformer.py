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

import torch
import torch.distributed as dist

import side_by_side
from fullshard import fully_shard
from fullshard.models import ModelArgs, Transformer


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    side_by_side.add_training_args(parser)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    return parser.parse_args(argv)


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model_args = ModelArgs(
        n_layers=args.layers, vocab_size=side_by_side.VOCAB_SIZE, max_seq_len=args.seq, dim=args.dim, n_heads=4
    )
    model = Transformer(model_args)
    reference = copy.deepcopy(model) if dist.get_rank() == 0 else None
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    side_by_side.train_side_by_side(model, reference, lambda m, tokens, targets: m.loss(tokens, targets), args)


if __name__ == "__main__":
    side_by_side.main(__file__, parse_args, train)
