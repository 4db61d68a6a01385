"""The step room: the per-module hooks, the root's lazy init (with the check that the
ranks sharded the same model) and what a root's units share (``state.py``), the
schedule that orders gathers and prefetches (``schedule.py``) and its checking twin
at DETAIL debug level (``exec_order.py``).
This face names what the engine's entry point and the front ends may use.
"""

from .state import ModuleState, get_state, module_class_name

__all__ = ["ModuleState", "get_state", "module_class_name"]
