"""Small reference models shared by the tests, examples, CLI and benchmarks."""

from .mlp import MLP
from .transformer import Attention, FeedForward, ModelArgs, Transformer, TransformerBlock

__all__ = ["MLP", "Attention", "FeedForward", "ModelArgs", "Transformer", "TransformerBlock"]
