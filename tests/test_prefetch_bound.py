"""At most one prefetched unit in flight without gather buckets: while a unit
computes, the only other unit gathered (or being gathered) is the next one, in
forward and in backward, so a step's memory is bounded by two units' full
parameters (plus the root's). Explicit prefetch lists raise the bound on purpose,
and so do buckets of small units (bounded by their bytes instead:
tests/test_bucketed_collectives.py)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fullshard import fully_shard, set_all_gather_bucket_size
from fullshard._core.step.state import get_state
from fullshard.models import ModelArgs, Transformer
from fullshard.testing.fake_group import fake_world

ARGS = ModelArgs(n_layers=4, vocab_size=32, max_seq_len=8, dim=16, n_heads=4)


class GatheredUnits(TorchDispatchMode):
    """The most block units unsharded or with an all-gather in flight at any op."""

    def __init__(self, groups: list) -> None:
        super().__init__()
        self.groups = groups
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        gathered = sum(1 for g in self.groups if g.is_unsharded or g._all_gather is not None)
        self.most = max(self.most, gathered)
        return func(*args, **(kwargs or {}))


def most_gathered(explicit: bool) -> tuple[int, int]:
    """(forward, backward) maxima of a step after a warm-up step."""
    torch.manual_seed(0)
    model = Transformer(ARGS)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    set_all_gather_bucket_size(model, 0)
    if explicit:
        model.layers[0].set_modules_to_forward_prefetch([model.layers[1], model.layers[2]])
    groups = [get_state(layer).group for layer in model.layers]
    tokens = torch.randint(ARGS.vocab_size, (2, 8))
    model.loss(tokens, tokens).backward()
    with GatheredUnits(groups) as forward:
        loss = model.loss(tokens, tokens)
    with GatheredUnits(groups) as backward:
        loss.backward()
    return forward.most, backward.most


def test_at_most_one_unit_prefetched_without_buckets():
    with fake_world(2):
        assert most_gathered(explicit=False) == (2, 2)  # the running unit and the next one
        assert most_gathered(explicit=True)[0] == 3  # two explicit targets: the count sees them
