"""The embedded training text and its batches: byte-level, deterministic per step.

The corpus is Lewis Carroll's "Alice's Adventures in Wonderland" (1865, public
domain; the Project Gutenberg edition with its header and licence removed),
shipped in the package so that ``fullshard train`` needs no download. Tokens
are bytes (vocabulary 256).

A step's batch depends only on (seed, step), never on what ran before, so a
run resumed from a checkpoint at step k sees exactly the batches the
uninterrupted run saw after step k, at any world size.
"""

from __future__ import annotations

from importlib import resources

import torch

__all__ = ["Corpus", "VOCAB_SIZE"]

VOCAB_SIZE = 256
_VALIDATION_FRACTION = 0.05


class Corpus:
    """The text as one tensor of byte tokens, split into training and validation parts."""

    def __init__(self, text: bytes | None = None) -> None:
        if text is None:
            text = (resources.files(__package__) / "data" / "alice.txt").read_bytes()
        tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        split = int(len(tokens) * (1 - _VALIDATION_FRACTION))
        self.train, self.validation = tokens[:split], tokens[split:]

    def batch(
        self, step: int, seed: int, batch_size: int, seq_len: int, validation: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step``: (inputs, targets), each ``batch_size x seq_len``.

        Raises:
            ValueError: the text is shorter than one sequence.
        """
        tokens = self.validation if validation else self.train
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"the corpus has {len(tokens)} tokens, fewer than a sequence of {seq_len} + 1")
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(len(tokens) - seq_len - 1, (batch_size,), generator=generator)
        windows = torch.stack([tokens[start : start + seq_len + 1] for start in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]

    @staticmethod
    def decode(tokens: list[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")
