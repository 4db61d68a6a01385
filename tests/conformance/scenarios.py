"""The scenario generator: (model, front end + settings, probe) tuples, covered pairwise, never hand-listed.

Every probe runs under every setting of its front end (strategy x ``use_orig_params`` x offload x mixed
precision, or the composable front end's settings); the model cycles through ``MODEL_KINDS`` so each
(setting, model) pair also appears. ``fast`` marks the subset ``make test`` runs (the rest runs in
``make test-exhaustive``): a fixed stride through the list, so every probe appears in it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .models import MODEL_KINDS

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
SUMMON_FLAGS = ("writeback", "rank0_only", "offload_to_cpu", "with_grads")

# Probes that build their model with other wrapping arguments, train, and take a full state dict.
UNIT_PROBES = (
    "ignored_modules",
    "ignored_states",
    "ignored_module_invalid",
    "policy_size",
    "policy_lambda",
    "policy_transformer",
    "policy_classes",
    "policy_custom",
)

WRAPPER_PROBES = (
    "train",
    "grads_after_backward",
    "several_forwards",
    "no_sync",
    "read_after_forward",
    "sd_full",
    "sd_full_rank0_cpu",
    "sd_sharded",
    "sd_local",
    "load_after_forward",
    "osd_full",
    "osd_sharded",
    "osd_full_legacy",
    "osd_optim_input",
    "osd_no_param_groups",
    "osd_unmanaged_param",
    "osd_rekey",
    "clip_root",
    "clip_nonroot",
    "inplace_change",
    "data_assign",
    "replace_param",
    "shape_change",
    "grad_data_assign",
    "change_between_forward_backward",
    "two_optimizers",
    "apply",
    "apply_in_summon",
    "summon_in_forward",
    "summon_in_backward",
    "wrong_sd_config",
    "eval_full_precision",
    "autocast_loss",
    "world_one",
    *UNIT_PROBES,
    "osd_nonroot",
    "osd_partly_wrapped",
    "accumulate_counts",
    "sd_in_forward",
    "clip_in_backward",
    "two_optimizers_osd",
    "eval_half_root",
) + tuple(
    "summon:" + ",".join(f for f, on in zip(SUMMON_FLAGS, bits) if on) for bits in itertools.product((0, 1), repeat=4)
)
COMPOSABLE_PROBES = (
    "train",
    "several_forwards",
    "no_sync",
    "read_after_forward",
    "sd_composable",
    "clip_composable",
    "shared_across_units",
    "load_after_forward",
    "two_optimizers",
    "ignored_params",
    "accumulate_counts",
    "sd_in_forward",
    "autocast_loss",
    "norm_full_precision",
)
# Probes about one model kind; the others cycle through ``MODEL_KINDS``.
PROBE_MODEL = {"norm_full_precision": "norm"}


@dataclass(frozen=True)
class Scenario:
    world: int
    front: str  # "wrapper" (FullyShardedDataParallel) or "composable" (fully_shard)
    model: str
    probe: str
    strategy: str = "FULL_SHARD"  # wrapper: a ShardingStrategy name; composable: "reshard" / "keep" / "hsdp"
    use_orig_params: bool = False
    offload: bool = False
    mixed: bool = False  # bf16 parameters, reductions and buffers
    fast: bool = False

    @property
    def name(self) -> str:
        flags = [self.strategy, f"uop={int(self.use_orig_params)}" if self.front == "wrapper" else ""]
        flags += ["offload" if self.offload else "", "bf16" if self.mixed else ""]
        return f"w{self.world}/{self.front}/{self.model}/{'+'.join(f for f in flags if f)}/{self.probe}"


def _wrapper_settings() -> list[tuple[str, bool, bool, bool]]:
    return list(itertools.product(STRATEGIES, (False, True), (False,), (False, True)))


def _composable_settings() -> list[tuple[str, bool, bool, bool]]:
    return [(s, False, off, mp) for s in ("reshard", "keep", "hsdp") for off in (False, True) for mp in (False, True)]


def generate(world: int) -> list[Scenario]:
    """Every probe x every setting of its front end, at ``world`` ranks."""
    out: list[Scenario] = []
    fronts = (
        ("wrapper", WRAPPER_PROBES, _wrapper_settings()),
        ("composable", COMPOSABLE_PROBES, _composable_settings()),
    )
    for front, probes, settings in fronts:
        for p_index, probe in enumerate(probes):
            for s_index, (strategy, uop, offload, mixed) in enumerate(settings):
                model = PROBE_MODEL.get(probe, MODEL_KINDS[(p_index + s_index) % len(MODEL_KINDS)])
                out.append(Scenario(world, front, model, probe, strategy, uop, offload, mixed))
    # torch's FSDP1 cannot offload on a machine without an accelerator (known.TORCH_FAILURES): the
    # wrapper's CPUOffload is compared with torch's run without offload (the same values), once per strategy.
    out += [Scenario(world, "wrapper", "nested", "train", s, uop, True) for s in STRATEGIES for uop in (False, True)]
    return out


# The matrix CI runs: a fixed stride through each world's list (every probe and setting appears at 2
# ranks), and every FAST_EVERY-th of the 2-rank ones in ``make test`` (the rest in make test-exhaustive). Every third 2-rank scenario
# (704 in all, 604 compared with torch; every second one was 1,056 and a fifth of make test's time).
STRIDE = {2: 3, 4: 7}
FAST_EVERY = 16


def matrix() -> list[Scenario]:
    chosen: list[Scenario] = []
    for world, stride in STRIDE.items():
        # The offset moves every 7 scenarios, so a stride that divides a probe's settings count still
        # reaches every setting.
        picked = [s for i, s in enumerate(generate(world)) if (i + i // 7) % stride == 0]
        chosen += [Scenario(**{**s.__dict__, "fast": world == 2 and i % FAST_EVERY == 0}) for i, s in enumerate(picked)]
    return chosen
