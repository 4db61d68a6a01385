"""The program torchrun starts on every rank: ``python -m fullshard.training '<TrainConfig JSON>'``.

The process group comes from torchrun's environment: NCCL where CUDA is, gloo
otherwise. ``record`` hands an exception's traceback to the launcher, which
names the failing rank.
"""

from __future__ import annotations

import gc
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from .config import TrainConfig
from .loop import train


@record
def main() -> None:
    config = TrainConfig.from_json(sys.argv[1])
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(config.threads or max(1, (os.cpu_count() or 1) // local_ranks))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        result = train(config)
    finally:
        # The model, its units and their meshes are garbage in reference cycles now: collect
        # them while the groups they hold are still valid, not in the interpreter's teardown.
        gc.collect()
        dist.destroy_process_group()
    if result.interrupted:
        sys.exit(130)  # the shell's code for "stopped by Ctrl-C"


if __name__ == "__main__":
    main()
