"""Model and optimizer state dicts: full, sharded and local, for both front ends.

- ``model.py``: what ``state_dict()`` returns per unit (``set_state_dict_type``,
  ``state_dict_type``, ``full_state_dict``) and the hooks that make each unit save
  and load in that form (see [Note: State dict hooks]);
- ``flat_param_hooks.py``: the wrapper's flat parameter in LOCAL state dicts;
- ``optim.py``: optimizer state dicts keyed by parameter FQN (see [Note: Model order]).
"""

from __future__ import annotations

from .model import full_state_dict, get_state_dict_type, set_state_dict_type, state_dict_type
from .optim import optim_state_dict, optim_state_dict_to_load

__all__ = [
    "full_state_dict",
    "get_state_dict_type",
    "optim_state_dict",
    "optim_state_dict_to_load",
    "set_state_dict_type",
    "state_dict_type",
]
