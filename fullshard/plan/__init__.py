"""Per-rank memory and bytes per step of training the reference ``Transformer`` with fullshard.

    from fullshard.models import get_preset
    from fullshard.plan import PlanConfig, estimate

    plan = estimate(PlanConfig(get_preset("gpt-7b"), world_size=64, strategy="full", batch_size=1))
    plan.peak, plan.peak_breakdown, plan.comm_bytes   # bytes per rank; bytes per rank and step

Pure arithmetic (no torch.distributed, no tensors), so any world size from 1 to
10,000+ is answered in about a millisecond. ``fullshard plan`` prints and plots
these numbers (``fullshard/cli/plan.py``).

- ``config.py``   what to estimate (``PlanConfig``) and the answer (``Plan``)
- ``units.py``    the model's units, their padded shards, and the bytes each collective moves
- ``replay.py``   peak memory: one training step replayed allocation by allocation
- ``estimate.py`` ``estimate()``: the three put together

Any model (``plan()``: the configuration that fits and runs fastest):

    from fullshard.plan import plan

    result = plan(model_fn, example_batch_fn, world_size=64, memory_limit_gib=80, global_batch=512)
    print(result.report())

- ``blocks.py``     which modules become units (the repeated blocks)
- ``trace.py``      one step on fake tensors: allocations, unit boundaries, FLOPs
- ``model_step.py`` how the model is called and its loss taken
- ``choice.py``     one configuration (``Choice``)
- ``playback.py``   a trace with the engine's buffers (``replay.EngineReplay``): peak and step time
- ``step_time.py``  the step-time model; ``profiles.py`` the devices; ``calibrate.py`` this machine
- ``search.py``     ``plan()``: candidates, ranking, the report
- ``apply.py``      a choice applied to a model, or printed as code; ``measure.py`` a choice run for real
"""

from .choice import Choice
from .config import STRATEGIES, Plan, PlanConfig
from .estimate import estimate
from .search import ModelPlan, plan

__all__ = ["STRATEGIES", "Choice", "ModelPlan", "Plan", "PlanConfig", "estimate", "plan"]
