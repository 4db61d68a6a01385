"""Named sizes of the reference ``Transformer``, for the CLI, the planner and benchmarks.

The small ones are what runs on this project's CPUs (``gpt-tiny`` is the demo
model, ``gpt-30m`` the benchmark model of ``benchmarks/bench.py``); the large
ones use the published GPT-2 / GPT-3 dimensions so that ``fullshard plan`` can
answer "how many ranks does this need". Our block is the GPT-2 block (GELU MLP
of width 4 x dim, LayerNorm), so the counts are those papers' counts; the
vocabulary is GPT-2's padded to a multiple of 64.
"""

from __future__ import annotations

import dataclasses

from .transformer import ModelArgs

__all__ = ["PRESETS", "get_preset"]

_GPT2_VOCAB = 50304  # 50257 rounded up to a multiple of 64

PRESETS: dict[str, ModelArgs] = {
    "gpt-tiny": ModelArgs(n_layers=4, dim=64, n_heads=4, vocab_size=256, max_seq_len=64),
    "gpt-30m": ModelArgs(n_layers=8, dim=576, n_heads=8, vocab_size=256, max_seq_len=128),
    "gpt-125m": ModelArgs(n_layers=12, dim=768, n_heads=12, vocab_size=_GPT2_VOCAB, max_seq_len=1024),
    "gpt-350m": ModelArgs(n_layers=24, dim=1024, n_heads=16, vocab_size=_GPT2_VOCAB, max_seq_len=1024),
    "gpt-1.3b": ModelArgs(n_layers=24, dim=2048, n_heads=16, vocab_size=_GPT2_VOCAB, max_seq_len=2048),
    "gpt-7b": ModelArgs(n_layers=32, dim=4096, n_heads=32, vocab_size=_GPT2_VOCAB, max_seq_len=2048),
    "gpt-13b": ModelArgs(n_layers=40, dim=5120, n_heads=40, vocab_size=_GPT2_VOCAB, max_seq_len=2048),
    "gpt-175b": ModelArgs(n_layers=96, dim=12288, n_heads=96, vocab_size=_GPT2_VOCAB, max_seq_len=2048),
}


def get_preset(name: str, **overrides: int | None) -> ModelArgs:
    """The ``ModelArgs`` of a named size, with some fields replaced.

    Args:
        name: a key of ``PRESETS`` (e.g. ``"gpt-7b"``).
        **overrides: ``ModelArgs`` fields to change (``n_layers=2``); None values are ignored.

    Returns:
        A new ``ModelArgs``.

    Raises:
        ValueError: unknown name or field.
    """
    if name not in PRESETS:
        raise ValueError(f"get_preset expects one of {', '.join(PRESETS)} but got {name!r}")
    fields = {f.name for f in dataclasses.fields(ModelArgs)}
    unknown = set(overrides) - fields
    if unknown:
        raise ValueError(f"get_preset expects ModelArgs fields but got {sorted(unknown)}")
    return dataclasses.replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})
