"""Train a Hugging Face GPT-2 or Llama on N CPU ranks with ``fully_shard``, next to a one-process run.

    pip install -e '.[hf]'                                          # transformers
    python examples/train_hf.py --nproc 2                           # GPT-2, launches torchrun itself
    python examples/train_hf.py --nproc 2 --model llama
    torchrun --nproc-per-node 2 examples/train_hf.py --model llama  # the same, by hand

The model is built from a small config (random weights, nothing downloaded).
Each decoder block is one unit; the root unit holds the embeddings, the final
norm and the head (GPT-2's head is tied to its token embedding: both live in
the root unit). Rank 0 also trains an unsharded copy on the whole batch; the
two loss curves must agree up to float rounding.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import side_by_side
from fullshard import fully_shard

try:
    import transformers
except ImportError as exc:
    raise SystemExit("examples/train_hf.py needs transformers: pip install -e '.[hf]'") from exc


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    side_by_side.add_training_args(parser)
    parser.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    return parser.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[nn.Module, nn.ModuleList]:
    """The model and its list of decoder blocks."""
    if args.model == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=side_by_side.VOCAB_SIZE, n_positions=args.seq, n_embd=args.dim, n_layer=args.layers,
            n_head=4, bos_token_id=0, eos_token_id=0,  # GPT-2's 50256 is outside this vocabulary
            # GPT-2 defaults to dropout 0.1: the two runs would draw different
            # masks, so their losses could not be compared step by step.
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
        model = transformers.GPT2LMHeadModel(config)
        return model, model.transformer.h
    config = transformers.LlamaConfig(
        vocab_size=side_by_side.VOCAB_SIZE, hidden_size=args.dim, intermediate_size=4 * args.dim,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=args.seq,
    )
    model = transformers.LlamaForCausalLM(config)
    return model, model.model.layers


def lm_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model, blocks = build(args)
    name = type(model).__name__
    reference = copy.deepcopy(model) if dist.get_rank() == 0 else None
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    if dist.get_rank() == 0:
        print(f"{name}: one unit per block ({len(blocks)}) + the root unit")
    side_by_side.train_side_by_side(model, reference, lm_loss, args)


if __name__ == "__main__":
    side_by_side.main(__file__, parse_args, train)
