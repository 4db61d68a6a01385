"""The FSDP1 wrapper's place in module-tree names.

``FullyShardedDataParallel`` holds the module it wraps as ``_fsdp_wrapped_module``,
so a walk of a wrapped model's tree names a parameter
``_fsdp_wrapped_module.layer._fsdp_wrapped_module.weight``. State dicts, messages
and ``summon_full_params`` show the names of the unwrapped model instead; the
engine gets ``model_name`` through ``UnitConfig.name_in_model``.
"""

from __future__ import annotations

WRAPPED_MODULE = "_fsdp_wrapped_module"
WRAPPER_PREFIX = WRAPPED_MODULE + "."


def model_name(name: str) -> str:
    """``name`` without the wrapper's segments: as in the unwrapped model."""
    return name.replace(WRAPPER_PREFIX, "")


# torch's checkpoint_wrapper holds the module it wraps under this name; state dicts leave it out.
CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


def state_dict_name(name: str) -> str:
    """``name`` as state dicts key it: without the wrapper's segments nor checkpoint wrappers'
    (whose own state-dict hook drops theirs from model state dicts; optimizer state dicts follow)."""
    return model_name(name).replace(CHECKPOINT_PREFIX, "")
