"""torchtitan's ``parallelize_llama`` with meta-device init over fullshard (issue 22, breakage 4).

torchtitan builds its Llama on the meta device, applies ``fully_shard`` per
block and ``fully_shard([norm, output])``, then ``to_empty()`` and
``init_weights()``: the multi-module unit used to stay on meta there. It
imports torch's ``fully_shard`` when first imported, so the test imports its
parallelize module again after ``fullshard.use_in_place_of_torch()`` (as a
user would import torchtitan after the call). Losses equal torch's FSDP2's.

torchtitan needs triton to import (about 1 GB): ``make test-libraries`` runs
this file; elsewhere it is skipped when triton is absent.
"""

import contextlib
import importlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fullshard
from fullshard.testing import distributed

pytestmark = pytest.mark.libraries
pytest.importorskip("triton", reason="torchtitan imports triton (about 1 GB): make test-libraries installs it")
torchtitan = pytest.importorskip("torchtitan", reason="torchtitan is an optional test dependency")

SEQ_LEN, VOCAB = 16, 64


def run_parallelize_llama(use_fullshard: bool) -> list[float]:
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.config import JobConfig
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    parallel_dims.device_type = "cpu"  # torchtitan assumes an accelerator (cuda) when it finds none
    with fullshard.use_in_place_of_torch() if use_fullshard else contextlib.nullcontext():
        parallelize = importlib.reload(importlib.import_module("torchtitan.models.llama3.infra.parallelize"))
        dims = parallel_dims.ParallelDims(
            dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=dist.get_world_size()
        )
        dims.build_mesh()
        args = TransformerModelArgs(
            dim=32, n_layers=2, n_heads=4, vocab_size=VOCAB, max_seq_len=SEQ_LEN, multiple_of=16
        )
        with torch.device("meta"):
            model = Transformer(args)
        job = JobConfig()
        job.training.seq_len = SEQ_LEN
        job.training.mixed_precision_param = "float32"
        job.activation_checkpoint.mode = "none"
        parallelize.parallelize_llama(model, dims, job)
        unit_class = fullshard.FSDPModule if use_fullshard else torch.distributed.fsdp.FSDPModule
        assert isinstance(model.norm, unit_class) and isinstance(model.output, unit_class)
        for unit in (m for m in model.modules() if isinstance(m, unit_class)):
            unit.set_force_sum_reduction_for_comms(True)  # torch's divide factor 1.0 uses PREMUL_SUM: not on gloo
        model.to_empty(device="cpu")
        assert not [name for name, p in model.named_parameters() if p.is_meta], "to_empty left parameters on meta"
        torch.manual_seed(0)
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
        return _train(model)


def _train(model: torch.nn.Module) -> list[float]:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(3):
        tokens = torch.randint(0, VOCAB, (2, SEQ_LEN + 1), generator=generator)
        logits = model(tokens[:, :-1])
        # torchtitan turns FSDP's averaging off and divides by the global token count.
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
        (loss / (tokens[:, 1:].numel() * dist.get_world_size())).backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


@distributed(world_size=2)
def test_parallelize_llama_meta_init_trains_like_torch():
    assert run_parallelize_llama(True) == pytest.approx(run_parallelize_llama(False), rel=1e-5)
