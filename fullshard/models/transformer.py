"""A small GPT-style decoder: the model the tests, examples, CLI and benchmarks share.

Token + position embeddings, ``n_layers`` pre-norm blocks (causal
self-attention and a GELU MLP, each behind a LayerNorm), a final LayerNorm and
an output projection whose weight is tied to the token embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    n_layers: int = 2
    vocab_size: int = 8
    max_seq_len: int = 16
    dim: int = 16
    n_heads: int = 4
    dropout_p: float = 0.0
    weight_tying: bool = True

    @property
    def num_params(self) -> int:
        """Parameter count (the tied output weight counted once)."""
        block = 4 * self.dim * self.dim  # attention
        block += 8 * self.dim * self.dim + 5 * self.dim  # MLP (4x hidden)
        block += 4 * self.dim  # two LayerNorms
        embeddings = (self.vocab_size + self.max_seq_len) * self.dim
        head = 0 if self.weight_tying else self.vocab_size * self.dim
        return self.n_layers * block + embeddings + 2 * self.dim + head


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        if args.dim % args.n_heads != 0:
            raise ValueError(f"ModelArgs expects dim divisible by n_heads but got {args.dim} and {args.n_heads}")
        self.n_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.dropout_p = args.dropout_p
        # No biases: a key bias has an exactly-zero gradient (softmax ignores a
        # shift), which adaptive optimizers turn into noise-driven updates.
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q, k, v = (w(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        dropout = self.dropout_p if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, dropout_p: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.w2 = nn.Linear(hidden_dim, dim)
        self.dropout = nn.Dropout(dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(F.gelu(self.w1(x))))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def _init_gpt2_style(module: nn.Module) -> None:
    """N(0, 0.02) weights and zero biases: with the default N(0, 1) embedding
    tied to the output, initial logits would be huge."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class Transformer(nn.Module):
    """Decoder-only transformer; ``forward(tokens) -> logits``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.dropout = nn.Dropout(args.dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.weight_tying:
            self.output.weight = self.tok_embeddings.weight
        self.apply(_init_gpt2_style)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _, seq_len = tokens.shape
        if seq_len > self.args.max_seq_len:
            raise ValueError(f"Transformer expects at most {self.args.max_seq_len} tokens but got {seq_len}")
        positions = torch.arange(seq_len, device=tokens.device)
        h = self.dropout(self.tok_embeddings(tokens) + self.pos_embeddings(positions))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self(tokens), targets)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits against the next tokens, in fp32. A function of the
    logits, so a model wrapped by the FSDP1 wrapper is called through its wrapper
    (``wrapper.loss`` would reach the inner module and skip the root's gather)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
