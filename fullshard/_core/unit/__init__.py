"""The unit room: one unit's lifecycle and its parameters' forms in one class
(``group.py``), and full parameters on demand outside the step
(``full_params.py``). This face names what the rooms above and the front ends may use.
"""

from . import full_params
from .group import (
    ParamGroup,
    UnitUse,
    buffer_param,
    outside_transforms,
    prefetch_following,
    register_param_unit,
    unit_of,
)

__all__ = [
    "ParamGroup",
    "UnitUse",
    "buffer_param",
    "full_params",
    "outside_transforms",
    "prefetch_following",
    "register_param_unit",
    "unit_of",
]
