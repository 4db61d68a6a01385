"""A profiled step reads like the data flow: each unit's all-gather, copy-out,
reshard and reduction stages are ``record_function`` ranges named with the
unit's FQN (see [Note: Profiler labels] in ``fullshard/_core/trace.py``)."""

import torch
from torch.profiler import ProfilerActivity, profile

from fullshard import MixedPrecisionPolicy, fully_shard, hybrid_mesh
from fullshard.models import ModelArgs, Transformer
from fullshard.testing.fake_group import fake_world

ARGS = ModelArgs(n_layers=2, vocab_size=32, max_seq_len=8, dim=16, n_heads=4)
UNITS = ["layers.0", "layers.1", "<root>"]


def profiled_step_names() -> set[str]:
    """Names of the ranges of one step of an HSDP (2 x 2) bf16 model, after a warm-up step."""
    torch.manual_seed(0)
    model = Transformer(ARGS)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = hybrid_mesh("cpu", num_devices_per_node=2)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    tokens = torch.randint(ARGS.vocab_size, (2, 8))
    model.loss(tokens, tokens).backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model.loss(tokens, tokens).backward()
    return {event.name for event in prof.events()}


def test_profiler_labels_name_every_stage_of_every_unit():
    with fake_world(4):
        names = profiled_step_names()
    stages = ["all_gather_copy_in", "all_gather", "copy_out", "reshard", "reduce_copy_in", "reduce_scatter"]
    stages += ["all_reduce", "reduce_copy_out"]
    missing = [f"fullshard::{stage}({unit})" for unit in UNITS for stage in stages]
    missing = [label for label in missing if label not in names]
    assert not missing, f"not in the trace: {missing}"
    assert not [name for name in names if name.startswith("fullshard::") and "(" not in name]
