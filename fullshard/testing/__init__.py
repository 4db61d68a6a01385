"""Multi-process test utilities, importable by users' own tests too.

- ``distributed(world_size)``: decorator that runs a pytest test on N gloo ranks.
- ``run_distributed(fn, world_size, ...)``: the same for a plain function.
- ``train_in_parity`` / ``assert_params_equal``: compare against a local model.
- ``case(label)``: names the table row a failure came from (tables run in one spawn).
"""

from .cases import case
from .harness import RankFailure, RankTimeout, distributed, run_distributed
from .parity import (
    DataParallelReference,
    assert_params_equal,
    clone_tree,
    full_value,
    mean_over,
    split_batch,
    train_in_parity,
    train_steps,
)

__all__ = [
    "DataParallelReference",
    "RankFailure",
    "RankTimeout",
    "assert_params_equal",
    "case",
    "clone_tree",
    "distributed",
    "full_value",
    "mean_over",
    "run_distributed",
    "split_batch",
    "train_in_parity",
    "train_steps",
]
