"""The reduce room: a unit's gradients from autograd to the sharded ``.grad``.

Gradient intake (``grads.py``: what goes in, where results land) and the
reduction pipeline (``reduction.py``: reduce-scatter, all-reduce, staged behind
the rest of backward). This face names what the rooms above may use.
"""

from .grads import GradIntake
from .reduction import ReductionQueue

__all__ = ["GradIntake", "ReductionQueue"]
