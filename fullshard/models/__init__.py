"""Small reference models shared by the tests, examples, CLI and benchmarks."""

from .mlp import MLP
from .presets import PRESETS, get_preset
from .transformer import Attention, FeedForward, ModelArgs, Transformer, TransformerBlock, next_token_loss

__all__ = [
    "MLP",
    "PRESETS",
    "Attention",
    "FeedForward",
    "ModelArgs",
    "Transformer",
    "TransformerBlock",
    "get_preset",
    "next_token_loss",
]
