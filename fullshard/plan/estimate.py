"""``estimate()``: units, then the step replay for memory and the collectives for bytes."""

from __future__ import annotations

from .config import Plan, PlanConfig
from .replay import StepReplay
from .units import comm_per_step, model_units


def estimate(config: PlanConfig) -> Plan:
    """Per-rank memory and bytes per step of one training step. See [Note: Plan model].

    Args:
        config: model, world size, strategy, batch and dtypes.

    Returns:
        A ``Plan`` for rank 0, in bytes.
    """
    units = model_units(config.model, config.shard_size, config.flat_params)
    replay = StepReplay(config, units)
    replay.run()
    shards = sum(u.shard_numel for u in units) * config.dtype.itemsize
    optimizer = shards * config.optimizer_states
    comm, calls = comm_per_step(config, units)
    return Plan(
        config=config,
        num_params=sum(u.numel for u in units),
        params=shards,
        grads=shards,
        optimizer_states=optimizer,
        largest_unit=max(u.gathered_numel for u in units) * config.compute_dtype.itemsize,
        activations=replay.activations,
        peak=replay.tape.peak,
        peak_phase=replay.tape.peak_phase,
        peak_breakdown={k: v for k, v in replay.tape.at_peak.items() if v},
        host=2 * shards + optimizer if config.cpu_offload else 0,
        comm=comm,
        comm_calls=calls,
    )
