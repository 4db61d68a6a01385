"""``torch.compile`` around and inside units, both front ends.

A unit's hooks gather, swap parameters and hook autograd; under a compiled
module they run eagerly (a graph break around the compiled forward), as
torch's FSDP's do. Training then equals one process, and the compiled code is
not recompiled step after step (the unsharded parameters persist across
steps, so the guards hold). ``aot_eager`` runs AOT autograd, what inductor
builds on, without needing a C++ compiler.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fullshard import FSDP, fully_shard
from fullshard.models import ModelArgs, Transformer, TransformerBlock
from fullshard.testing import distributed, train_in_parity
from fullshard.wrap import ModuleWrapPolicy

ARGS = ModelArgs(n_layers=2, vocab_size=32, max_seq_len=8, dim=16)


def make_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ARGS)


def batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(ARGS.vocab_size, (4, ARGS.max_seq_len), generator=generator)
    return [(tokens, tokens.roll(-1, dims=1))]


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    tokens, targets = batch
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


class CountingBackend:
    """``aot_eager`` that counts the graphs it is given."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph: torch.fx.GraphModule, inputs: list) -> object:
        from torch._dynamo.backends.debugging import aot_eager

        self.graphs += 1
        return aot_eager(graph, inputs)


def train_counting_graphs(model: nn.Module, ref: nn.Module, compiled: CountingBackend, steps: int = 4) -> list[int]:
    """Trains ``model`` next to ``ref`` (equal losses each step) and returns the graphs
    compiled so far after each step."""
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    counts = []
    for step in range(steps):
        train_in_parity(model, ref, *optims, batches(step), lm_loss)
        counts.append(compiled.graphs)
    return counts


def compile_fully_sharded(shard: object, how: str, backend: CountingBackend) -> tuple[nn.Module, Transformer]:
    """A copy of the model sharded per block and at the root by ``shard`` (ours or
    torch's ``fully_shard``), compiled as ``how`` says."""
    ref = make_model()
    model = copy.deepcopy(ref)
    for index, layer in enumerate(model.layers):
        if how == "compiled block made a unit":  # torchtitan's order
            model.layers[index] = torch.compile(layer, backend=backend)
            shard(model.layers[index])
        else:
            shard(layer)
            if how == "unit.compile()":
                layer.compile(backend=backend)
    shard(model)
    if how == "model.compile()":
        model.compile(backend=backend)
    return model, ref


@pytest.mark.parametrize("how", ["compiled block made a unit", "unit.compile()", "model.compile()"])
@distributed(world_size=2)
def test_fully_shard_under_compile(how):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch._dynamo.reset()
    ours = CountingBackend()
    counts = train_counting_graphs(*compile_fully_sharded(fully_shard, how, ours), ours)
    assert counts[0] > 0 and counts[1:] == counts[:1] * 3  # compiled in step 1, never again
    torch._dynamo.reset()
    theirs = CountingBackend()
    assert train_counting_graphs(*compile_fully_sharded(torch_fully_shard, how, theirs), theirs) == counts


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("how", ["model.compile()", "torch.compile(model)"])
@distributed(world_size=2)
def test_wrapper_under_compile(how, use_orig_params):
    torch._dynamo.reset()
    backend = CountingBackend()
    ref = make_model()
    model = FSDP(
        copy.deepcopy(ref),
        auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
        use_orig_params=use_orig_params,
        device_id=torch.device("cpu"),
    )
    if how == "model.compile()":
        model.compile(backend=backend)
    else:
        model = torch.compile(model, backend=backend)
    counts = train_counting_graphs(model, ref, backend)
    assert counts[0] > 0 and counts[1:] == counts[:1] * 3
