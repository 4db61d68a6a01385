"""Probes of the families added second (issue 23 §1-§2): units made by auto-wrap policies and ignored
states, optimizer state dicts of other shapes, calls made inside forward or backward, the collectives
of gradient accumulation, and precision settings. Registered in ``probes.PROBES`` on import (runner.py).
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from fullshard._core import comm

from .models import batch
from .probes import Run, full_osd_of, probe, state_dict_of, train
from .scenarios import UNIT_PROBES


@probe(*UNIT_PROBES)
def units_and_training(r: Run) -> None:
    """Which modules became units (auto-wrap policies, ignored states), then training and every view."""
    units = [name for name, m in r.model.named_modules() if isinstance(m, r.a.FSDP)]
    r.rec.put("units", tuple(name.replace("_fsdp_wrapped_module.", "") for name in units))
    train(r)
    sd = state_dict_of(r, "FULL_STATE_DICT")
    r.rec.put("keys", tuple(sorted(sd)))
    for key, value in sd.items():
        r.rec.put(f"sd:{key}", value)


@probe("osd_nonroot")
def osd_nonroot(r: Run) -> None:
    """The optimizer state dict asked of a unit below the root (the optimizer holds every parameter)."""
    r.step("loss0")
    with r.a.FSDP.state_dict_type(r.model, r.a.StateDictType.FULL_STATE_DICT):
        osd = r.a.FSDP.optim_state_dict(r.model.module.block1, r.optim)
    r.rec.put("state_keys", tuple(sorted(osd["state"], key=str)))
    for fqn, state in sorted(osd["state"].items()):
        for name, value in sorted(state.items()):
            r.rec.put(f"osd:{fqn}:{name}", value)


@probe("two_optimizers_osd")
def two_optimizers_osd(r: Run) -> None:
    """Two optimizers over one model, each one's full optimizer state dict (keys equal the model's). They
    split the model between units (FSDP1 needs every parameter of a unit in the optimizer it is asked of)."""
    blocks = [p for name, p in r.model.named_parameters() if p.requires_grad and "block" in name]
    rest = [p for name, p in r.model.named_parameters() if p.requires_grad and "block" not in name]
    optims = (torch.optim.SGD(blocks, lr=0.1, momentum=0.9), torch.optim.SGD(rest, lr=0.05, momentum=0.5))
    r.step("loss0", optims)
    for index, optim in enumerate(optims):
        osd = full_osd_of(r, optim)
        r.rec.put(f"state_keys{index}", tuple(sorted(osd["state"], key=str)))
        for fqn, state in sorted(osd["state"].items()):
            for name, value in sorted(state.items()):
                r.rec.put(f"osd{index}:{fqn}:{name}", value)
    r.step("loss1", optims)
    r.full_params()


@probe("clip_in_backward")
def clip_in_backward(r: Run) -> None:
    """``clip_grad_norm_`` on the root while backward is between units (from a hook on block1's output)."""
    r.step("loss0")

    def on_block1_output(_module: nn.Module, _args: tuple, out: torch.Tensor) -> None:
        out.register_hook(lambda grad: r.rec.put("norm_in_backward", r.model.clip_grad_norm_(0.05)))

    r.model.module.block1.register_forward_hook(on_block1_output)
    r.backward("loss1")


@probe("sd_in_forward")
def sd_in_forward(r: Run) -> None:
    """The model's state dict taken from inside its forward (a pre-hook of block1)."""
    block1 = r.model.module.block1 if r.wrapper else r.model.block1

    def hook(*_: object) -> None:
        sd = r.model.state_dict()
        r.rec.put("keys", tuple(sorted(sd)))
        for key, value in sd.items():
            r.rec.put(f"sd:{key}", value)

    r.step("loss0")
    block1.register_forward_pre_hook(hook)
    r.step("loss1")
    r.full_params()


@contextlib.contextmanager
def _count_collectives(r: Run, counts: Counter, phase: str) -> Iterator[None]:
    """Counts the collectives issued in the block by kind: torch's FSDP through ``torch.distributed``'s
    functions (patched for the block), fullshard through its comm spy."""
    if r.a.lib != "torch":
        with comm.record_comms() as records:
            yield
        counts.update(f"count:{phase}:{record.op}" for record in records)
        return
    kinds = {  # FSDP1 calls the list and ``_single`` forms on CPU, FSDP2 the ``_tensor`` ones
        "all_gather": "all_gather",
        "all_gather_single": "all_gather",
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter": "reduce_scatter",
        "reduce_scatter_single": "reduce_scatter",
        "reduce_scatter_tensor": "reduce_scatter",
        "all_reduce": "all_reduce",
        "broadcast": "broadcast",
    }
    kinds = {name: kind for name, kind in kinds.items() if hasattr(dist, name)}
    originals = {name: getattr(dist, name) for name in kinds}

    def counting(name: str) -> Callable:
        def call(*args: object, **kwargs: object) -> object:
            counts[f"count:{phase}:{kinds[name]}"] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in kinds:
        setattr(dist, name, counting(name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


@probe("accumulate_counts")
def accumulate_counts(r: Run) -> None:
    """Gradient accumulation: two micro-batches without gradient sync, one with; collectives per phase
    (ours one all-gather per unit, as torch's: buckets are tests/test_bucketed_collectives.py's)."""
    r.step("loss0")  # lazy initialisation out of the count
    if r.a.lib != "torch":
        from fullshard import set_all_gather_bucket_size

        set_all_gather_bucket_size(r.model, 0)
    counts: Counter = Counter()
    with _count_collectives(r, counts, "accumulate"):
        if r.wrapper:
            with r.model.no_sync():
                r.backward("micro0")
                r.backward("micro1")
        else:
            r.model.set_requires_gradient_sync(False)
            r.backward("micro0")
            r.backward("micro1")
            r.model.set_requires_gradient_sync(True)
    with _count_collectives(r, counts, "sync"):
        r.backward("micro2")
    for key, count in sorted(counts.items()):
        r.rec.put(key, count)
    r.optim.step()
    r.full_params()


@probe("eval_half_root")
def eval_half_root(r: Run) -> None:
    """FSDP_USE_FULL_PREC_IN_EVAL when the model itself is in bf16 (its compute dtype fp16)."""
    r.step("loss0")
    os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = "1"
    try:
        r.model.eval()
        with torch.no_grad():
            out = r.model(batch(7, dist.get_rank()).to(torch.bfloat16))
        r.rec.put("eval_out", out)
    finally:
        del os.environ["FSDP_USE_FULL_PREC_IN_EVAL"]
    r.model.train()
    r.full_params()


@probe("norm_full_precision")
def norm_full_precision(r: Run) -> None:
    """Norm modules in their own fp32 units inside a (maybe) bf16 model: output dtype, training values."""
    out = r.model(batch(0, dist.get_rank()))
    r.rec.put("out", out)
    out.float().pow(2).mean().backward()
    r.optim.step()
    r.optim.zero_grad()
    r.step("loss1")
    r.full_params()
