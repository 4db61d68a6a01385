"""What the matrix knows: where torch's FSDP itself fails or is wrong on CPU, our deliberate differences,
and the differences still open (issue 23). Each row names the scenarios and differences it covers, and why.

- ``TORCH_FAILURES``: torch's FSDP cannot run the scenario here. Fullshard's record is then compared with
  torch's record of a stand-in scenario that differs only in the setting torch cannot run and that changes
  no value (offloading moves tensors, not numbers), or with the error our documentation names.
- ``TORCH_WRONG``: torch's value is wrong; ours is what its documentation says (a value difference allowed
  only here, each with its proof).
- ``DELIBERATE``: a difference of a kind other than ``value`` that we keep, listed in docs/api.md under
  "Deliberate differences from torch".
- ``OPEN``: found by the matrix and not fixed yet: each is a TODO of issue 23 (never a ``value``
  difference: those are fixed first).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

from .record import Difference
from .scenarios import Scenario


class TorchFailure(NamedTuple):
    """``applies(s)``: torch cannot run ``s``. Ours is checked against torch's record of ``stand_in(s)``
    (every value equal), or must raise ``raises`` (documented in docs/api.md)."""

    applies: Callable[[Scenario], bool]
    reason: str
    stand_in: Callable[[Scenario], Scenario] | None = None
    raises: str | None = None


class Row(NamedTuple):
    """Covers difference ``d`` of scenario ``s`` when ``applies(s)``, ``d.kind`` is in ``kinds`` and
    ``d.key`` matches ``key`` (a regex, searched)."""

    applies: Callable[[Scenario], bool]
    kinds: tuple[str, ...]
    key: str
    reason: str

    def covers(self, s: Scenario, d: Difference) -> bool:
        return self.applies(s) and d.kind in self.kinds and re.search(self.key, d.key) is not None


def _wrapper(s: Scenario) -> bool:
    return s.front == "wrapper"


TORCH_FAILURES: tuple[TorchFailure, ...] = (
    TorchFailure(
        lambda s: _wrapper(s) and s.offload,
        "FSDP1's CPUOffload(offload_params=True) pins its shards at lazy init, which raises on a machine with no "
        "accelerator (RuntimeError: Cannot access accelerator device when none is available): fullshard "
        "offloads without pinning there; compared with torch without offload (same values)",
        stand_in=lambda s: replace(s, offload=False),
    ),
    TorchFailure(
        lambda s: _wrapper(s) and ("offload_to_cpu" in s.probe or s.probe == "sd_full_rank0_cpu"),
        "FSDP1's offload_to_cpu on a CPU device frees the storage it then reads (RuntimeError: setStorage ... out "
        "of bounds for storage of size 0), on some ranks only with rank0_only (the others then hang): "
        "fullshard hands out CPU copies; compared with torch without offload_to_cpu (same values)",
        stand_in=lambda s: replace(s, probe=_without_offload_to_cpu(s.probe)),
    ),
    TorchFailure(
        lambda s: _wrapper(s) and s.use_orig_params and s.probe == "sd_local",
        "FSDP1's LOCAL_STATE_DICT with use_orig_params=True saves the flat parameter next to the original "
        "parameters' local slices and then refuses to load its own dict (RuntimeError: Unexpected key(s) "
        "... _flat_param); fullshard raises NotImplementedError at save (docs/api.md)",
        raises="NotImplementedError",
    ),
    TorchFailure(
        lambda s: _wrapper(s) and s.use_orig_params and s.probe == "osd_optim_input",
        "FSDP1's full_optim_state_dict(optim_input=...) with use_orig_params=True fails its own padding check "
        "(AssertionError: Manually calculated _sharded_numel_padded is incorrect); compared with torch's "
        "full_optim_state_dict without optim_input (the same parameters, so the same state keys)",
        stand_in=lambda s: replace(s, probe="osd_optim_input_default"),
    ),
)


def _without_offload_to_cpu(probe: str) -> str:
    """The probe with ``offload_to_cpu`` left out (``sd_full_rank0_cpu``: rank0_only alone)."""
    if probe == "sd_full_rank0_cpu":
        return "sd_full_rank0"
    kind, _, flags = probe.partition(":")
    return kind + ":" + ",".join(f for f in flags.split(",") if f != "offload_to_cpu")


def single_state_optimizer(s: Scenario) -> bool:
    """FSDP1's full optimizer state dict with use_orig_params=True returns ``exp_avg_sq`` under ``exp_avg``
    too (Adam, gloo, torch 2.13: a gathered state overwritten by the next): those probes use SGD with
    momentum, one state per parameter, where torch's values are right and can be compared."""
    return (
        _wrapper(s)
        and s.use_orig_params
        and s.probe in ("osd_full", "osd_full_legacy", "osd_rekey", "osd_sharded", "osd_partly_wrapped", "osd_nonroot")
    )


_LAYOUT = (
    "with use_orig_params=True, fullshard shards each parameter by rows (FSDP2's layout, for both front ends); "
    "FSDP1 cuts the unit's concatenated parameters into equal parts: which elements of a parameter a rank "
    "holds, and so each rank's local view, differ (full values, state dicts by name and optimizer states are "
    "equal). With use_orig_params=False both hold FSDP1's flat shard: no row"
)

# The gradients of the parameters models.Net(kind="frozen") freezes (a wrapper name may hold
# ``_fsdp_wrapped_module.`` between the unit and its child).
FROZEN_GRAD_KEYS = r"^(param|summoned)\.grad:(.*\.)?(block1\.(_fsdp_wrapped_module\.)?lin1|mid)\.(weight|bias)(:type|:shape)?$"

TORCH_WRONG: tuple[Row, ...] = (
    Row(
        lambda s: _wrapper(s) and not s.use_orig_params and s.probe == "data_assign",
        ("value",),
        r"^(loss1|param:)",
        "`flat_param.data = t` (use_orig_params=False): FSDP1 uses t for the next forward only (not at all "
        "under mixed precision, which casts its old shard), then steps and keeps its old shard, so the "
        "assignment is lost; fullshard makes t the shard, as an assigned .data stays in a plain module "
        "(tests/test_wrapper_param_contract.py::test_flat_param_data_assignment_is_kept_like_a_plain_module "
        "checks it against one process)",
    ),
    Row(
        lambda s: (
            _wrapper(s) and s.strategy == "NO_SHARD" and s.probe.startswith("summon:") and "writeback" not in s.probe
        ),
        ("value",),
        r"^param:",
        "FSDP1 with NO_SHARD hands out the parameters themselves in "
        "summon_full_params(writeback=False), so changes persist; its documentation says they are discarded, "
        "and fullshard discards them under every strategy",
    ),
    Row(
        lambda s: _wrapper(s) and (s.strategy == "NO_SHARD" or "HYBRID" in s.strategy) and s.probe == "sd_full_rank0_cpu",
        ("keys",),
        r"^(keys$|sd:)",
        "FullStateDictConfig(rank0_only=True): torch's stand-in (rank0_only without offload_to_cpu, see "
        "TORCH_FAILURES) hands the full state dict to every rank under NO_SHARD, and to the first rank of each "
        "shard group under the hybrid strategies (global rank 2 of 4); its documentation says only rank 0 gets "
        "it, as fullshard does under every strategy (rank 0's keys and values are still compared)",
    ),
    Row(
        lambda s: _wrapper(s) and s.model == "frozen",
        ("value", "keys", "type"),
        FROZEN_GRAD_KEYS,
        "frozen parameters have no gradient: FSDP1 hands out zeros cut from its flat gradient for some of "
        "them under summon_full_params(with_grads=True); fullshard leaves .grad None, as a plain model does "
        "(only the frozen parameters' gradients: models.Net freezes block1.lin1 and mid)",
    ),
)

DELIBERATE: tuple[Row, ...] = (
    Row(
        lambda s: _wrapper(s) and not s.use_orig_params and s.probe == "shape_change",
        ("exception", "keys", "message"),
        r"",
        "a flat parameter given a tensor of another shape (use_orig_params=False): fullshard raises "
        "RuntimeError at the next forward, naming the unit and both shapes; FSDP1 fails an internal "
        "assertion under SHARD_GRAD_OP and the hybrid strategies and silently keeps its old shard otherwise",
    ),
    Row(
        lambda s: s.probe == "sd_in_forward",
        ("exception", "keys", "type"),
        r"",
        "state_dict() called inside forward: FSDP1 raises AssertionError (an internal state check; under NO_SHARD "
        "it returns the compute-dtype copies forward uses); torch's fully_shard reshards the root there, so the "
        "rest of that forward fails (RuntimeError: mixed torch.Tensor and DTensor); fullshard returns the state "
        "dict of the shards and the forward goes on",
    ),
    Row(
        lambda s: _wrapper(s) and s.model == "tied" and s.probe in ("policy_lambda", "policy_classes"),
        ("exception", "keys", "type", "warning", "layout"),
        r"",
        "a parameter shared by two units (auto-wrap policies that wrap each Linear of a tied pair): fullshard "
        "raises ValueError at construction and names the fix (as torch's fully_shard raises); FSDP1 accepts it, "
        "then fails in forward under mixed precision (RuntimeError: dtype mismatch) or trains without a word",
    ),
    Row(
        lambda s: _wrapper(s) and s.model == "buffers" and s.mixed and s.probe in ("policy_lambda", "policy_classes"),
        ("type",),
        r"^sd:scale$",
        "buffers of a root unit that holds no parameter of its own (every Linear wrapped): FSDP1's state dict "
        "keeps them in MixedPrecision's buffer_dtype, while a unit with parameters saves its buffers in their "
        "original dtype; fullshard saves every buffer in its original dtype",
    ),
    Row(
        lambda s: s.world == 2 and ("HYBRID" in s.strategy or s.strategy == "hsdp"),
        ("count",),
        r"^count:.*:all_reduce$",
        "hybrid sharding with one replica (2 ranks: a (1, 2) mesh): FSDP1 and fully_shard all-reduce each "
        "gradient over the one-rank replica group; fullshard skips a collective of one rank (same values)",
    ),
    Row(
        lambda s: _wrapper(s) and not s.use_orig_params and "HYBRID" in s.strategy and s.probe == "sd_local",
        ("exception", "keys", "layout"),
        r"",
        "LOCAL_STATE_DICT works for a wrapper given a device mesh (each rank's flat shard, as without one); "
        "FSDP1 raises RuntimeError and asks for SHARDED_STATE_DICT",
    ),
    Row(
        lambda s: _wrapper(s) and s.probe == "apply_in_summon",
        ("message",),
        r"^message$",
        "apply inside summon_full_params: FSDP1's message names its internal TrainingState values; ours names "
        "the call and the fix (same exception type)",
    ),
    Row(lambda s: not (_wrapper(s) and not s.use_orig_params), ("layout",), r"^local:", _LAYOUT),
    Row(
        lambda s: _wrapper(s) and s.use_orig_params and s.probe in ("read_after_forward", "two_optimizers"),
        ("type", "keys"),
        r"^after_forward:",
        "between forward and backward (use_orig_params=True), a unit kept gathered (the root under FULL_SHARD "
        "and HYBRID_SHARD, every unit under SHARD_GRAD_OP, _HYBRID_SHARD_ZERO2 and NO_SHARD) shows the "
        "Parameters backward uses, full and in the compute dtype; FSDP1 shows the root's 1-D shards, plain "
        "tensors under SHARD_GRAD_OP, the full-precision parameters under NO_SHARD with mixed precision. "
        "Matching would re-register every kept unit's parameters twice a step; values are equal where both "
        "are full",
    ),
    Row(
        lambda s: _wrapper(s) and not s.use_orig_params and "with_grads" in s.probe,
        ("exception", "keys", "type", "message", "layout"),
        r"",
        "summon_full_params(with_grads=True) works with use_orig_params=False too (FSDP1 raises "
        "NotImplementedError): the gradients are gathered like the parameters",
    ),
)

# Found and not fixed yet (TODOs of issue 23): none left. A new row reads
# Row(applies, kinds, key, "TODO(conformance): open difference of issue 23, ...").
OPEN: tuple[Row, ...] = ()


def torch_failure_row(s: Scenario) -> TorchFailure | None:
    """The row saying torch's FSDP cannot run ``s`` here, or None."""
    for row in TORCH_FAILURES:
        if row.applies(s):
            return row
    return None


def torch_failure(s: Scenario) -> str | None:
    """Why torch's FSDP cannot run ``s`` here, or None."""
    row = torch_failure_row(s)
    return row.reason if row is not None else None


def explain(s: Scenario, d: Difference) -> str | None:
    """The reason difference ``d`` of scenario ``s`` is known, or None (a failure of the matrix)."""
    for row in TORCH_WRONG:
        if row.covers(s, d):
            return row.reason
    if d.kind != "value":  # a value difference is fixed, or torch's own error: never open or deliberate
        for row in OPEN + DELIBERATE:
            if row.covers(s, d):
                return row.reason
    return None
