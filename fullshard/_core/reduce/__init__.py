"""The reduce room: a unit's gradients from autograd to the sharded ``.grad``.

Gradient intake (what goes in, where results land) and the reduction pipeline
(reduce-scatter, all-reduce, staged behind the rest of backward), one module:
``reduction.py``. This face names what the rooms above may use.
"""

from .reduction import GradIntake, ReductionQueue

__all__ = ["GradIntake", "ReductionQueue"]
