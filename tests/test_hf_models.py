"""Hugging Face ``transformers`` models under ``fully_shard``, one unit per decoder block.

Models: GPT-2 (``GPT2LMHeadModel``, LayerNorm, learned positions, head tied to
the token embedding) and Llama (``LlamaForCausalLM``, RMSNorm, rotary
positions, grouped-query attention, untied head), built from small configs with
random weights (nothing downloaded). The vocabulary (67 rows) does not divide
by the world size, so the embedding and head shards are padded.

Each rank trains its slice of every batch through HF's own loss
(``labels=``) with AdamW. The references are one process training an unsharded
copy: on each rank's slice in turn with averaged gradients
(``DataParallelReference``: losses, gradients and parameters to 1e-5 relative,
bf16 to 1e-4), and on the whole batch at once (see ``test_parity`` for why its
parameters drift apart by rounding noise on GPT-2's key bias).
"""

import copy
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import transformers

from fullshard import MixedPrecisionPolicy, full_state_dict, fully_shard
from fullshard.testing import (
    DataParallelReference,
    assert_params_equal,
    distributed,
    mean_over,
    split_batch,
)

VOCAB_SIZE = 67
SEQ = 16

# Out of the inner loop, and not even collected there (the Makefile's INNER_LOOP_SKIPS): importing transformers
# costs about 1 s before the first test; make test runs the file.
pytestmark = pytest.mark.slow


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB_SIZE, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
            bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # dropout would differ between the runs
        )
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=88, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )
    return transformers.LlamaForCausalLM(config)


def blocks(model: nn.Module) -> nn.ModuleList:
    return model.transformer.h if isinstance(model, transformers.GPT2LMHeadModel) else model.model.layers


def shard(model: nn.Module, **kwargs) -> nn.Module:
    for block in blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def token_batches(num: int, batch: int = 4, seed: int = 1) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(VOCAB_SIZE, (batch, SEQ), generator=generator),) for _ in range(num)]


def hf_loss(model: nn.Module, batch) -> torch.Tensor:
    (tokens,) = batch
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_in_parity_with_ranks(
    model: nn.Module, ref: nn.Module, num_steps: int, param_dtype: torch.dtype | None = None, **tolerance
) -> None:
    """Trains ``model`` on each rank's slice and ``ref`` in this one process
    on every rank's slice (``DataParallelReference``); asserts equal losses."""
    emulated = DataParallelReference(ref, hf_loss, param_dtype)
    optim, ref_optim = adamw(model), adamw(ref)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step, batch in enumerate(token_batches(num_steps)):
        loss = hf_loss(model, split_batch(batch, rank, world))
        loss.backward()
        ref_loss = emulated.backward([split_batch(batch, r, world) for r in range(world)])
        for opt in (optim, ref_optim):
            opt.step()
            opt.zero_grad()
        global_loss = mean_over(loss.float())
        torch.testing.assert_close(
            global_loss, ref_loss, **tolerance, msg=lambda m: f"step {step}: {global_loss} vs {ref_loss}: {m}"
        )


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@distributed(world_size=2)
def test_parity(kind):
    """5 AdamW steps against two one-process runs.

    ``ref`` runs each rank's slice in turn and averages the gradients
    (``DataParallelReference``): the same arithmetic, so losses, gradients and
    parameters agree to 1e-5 (bitwise on our machines). ``whole`` trains on the
    whole batch at once: losses and the first gradients agree to 1e-5, but not
    every parameter after several steps. GPT-2's key bias has a gradient that is
    zero in exact arithmetic (softmax ignores a constant added to a row of
    scores) and ~1e-11 of rounding noise in floats, which differs with the
    batch split; AdamW divides by its own magnitude and turns it into steps of
    up to lr * 1e-3, so those parameters drift apart by ~1e-5 (1e-4 allowed).
    """
    ref = make_model(kind)
    whole = copy.deepcopy(ref)
    model = shard(copy.deepcopy(ref))
    if kind == "gpt2":
        # Tied within the root unit: one sharded parameter under both names.
        assert model.lm_head.weight is model.transformer.wte.weight
    emulated = DataParallelReference(ref, hf_loss)
    optims = [adamw(m) for m in (model, ref, whole)]
    rank = dist.get_rank()
    for step, batch in enumerate(token_batches(5)):
        loss = hf_loss(model, split_batch(batch, rank, 2))
        loss.backward()
        global_loss = mean_over(loss)
        torch.testing.assert_close(global_loss, emulated.backward([split_batch(batch, r, 2) for r in range(2)]))
        whole_loss = hf_loss(whole, batch)
        whole_loss.backward()
        torch.testing.assert_close(global_loss, whole_loss.detach(), msg=lambda m: f"step {step}: {m}")
        if step == 0:
            assert_params_equal(model, ref, grads=True)
            assert_params_equal(model, whole, grads=True, rtol=1e-5, atol=1e-7)
        for opt in optims:
            opt.step()
            opt.zero_grad()
    assert_params_equal(model, ref)
    assert_params_equal(model, whole, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@distributed(world_size=2)
def test_parity_mixed_precision(kind):
    """bf16 parameters and compute, fp32 reduction and optimizer, to 1e-4 relative
    (bitwise on our machines).

    The reference runs each rank's slice through a bf16 copy and averages the
    fp32-cast gradients (``DataParallelReference``): the same arithmetic. Its
    copy keeps Llama's rotary ``inv_freq`` buffer in fp32, as the policy does.
    """
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ref = make_model(kind)
    model = shard(copy.deepcopy(ref), mp_policy=policy)
    train_in_parity_with_ranks(model, ref, 4, torch.bfloat16, rtol=1e-4, atol=1e-5)
    assert_params_equal(model, ref, rtol=1e-4, atol=1e-5)
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@distributed(world_size=2)
def test_state_dict_round_trip(kind):
    """State dicts keep HF's keys (the tied ``lm_head.weight`` included) and
    values; a full one saved with ``save_pretrained`` reloads in plain HF, and
    a sharded one loads into a fresh sharded model."""
    ref = make_model(kind)
    model = shard(copy.deepcopy(ref))
    train_in_parity_with_ranks(model, ref, 2)
    expected = ref.state_dict()

    full = full_state_dict(model)
    assert list(full) == list(expected)
    for key, value in expected.items():
        torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")

    sharded = model.state_dict()
    assert list(sharded) == list(expected)
    fresh = shard(make_model(kind, seed=1))
    fresh.load_state_dict(sharded)
    assert_params_equal(fresh, ref)
    if kind == "gpt2":
        assert fresh.lm_head.weight is fresh.transformer.wte.weight  # loading keeps the tie

    tokens = token_batches(1, seed=2)[0][0]
    logits = model(input_ids=tokens).logits.detach()
    # HF's own checkpoint format, on rank 0 only (no collectives). Without
    # state_dict=, save_pretrained would try to save the DTensor shards.
    if dist.get_rank() == 0:
        with tempfile.TemporaryDirectory() as path:
            model.save_pretrained(path, state_dict=full)
            loaded = type(ref).from_pretrained(path)
        torch.testing.assert_close(loaded(input_ids=tokens).logits, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("unit", ["transformer", "transformer.wte", "lm_head"])
@distributed(world_size=2)
def test_gpt2_tied_head_across_units_is_refused(unit):
    """GPT-2's head is tied to ``transformer.wte``: a unit holding one of the
    two but not the other, with the root holding the other, would split one
    parameter over two units; fully_shard refuses instead of silently untying."""
    model = make_model("gpt2")
    for block in blocks(model):
        fully_shard(block)
    fully_shard(model.get_submodule(unit))
    with pytest.raises(ValueError, match=r"^fully_shard expects each parameter to be managed by one unit"):
        fully_shard(model)
