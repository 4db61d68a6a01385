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
"""

from .config import STRATEGIES, Plan, PlanConfig
from .estimate import estimate

__all__ = ["STRATEGIES", "Plan", "PlanConfig", "estimate"]
