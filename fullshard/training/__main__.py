"""The program torchrun starts on every rank: ``python -m fullshard.training '<TrainConfig JSON>'``.

The process group comes from torchrun's environment: NCCL where CUDA is, gloo
otherwise. ``record`` hands an exception's traceback to the launcher, which
names the failing rank; under ``--max-restarts`` the agent starts every rank again, and
they resume from the newest complete checkpoint. A checkpoint that does not fit (another model, a
damaged file) is the user's mistake: one line and exit code 2, the traceback
only under ``--debug``.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ..checkpoint import CheckpointError
from .config import TrainConfig
from .loop import train
from .resume import saved_step


def after_restart(config: TrainConfig) -> TrainConfig:
    """``config`` for a restart by the elastic agent (``--max-restarts``): the ranks resume from
    the newest complete checkpoint, whatever the first launch said."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0:
        return config
    step = saved_step(config)
    if int(os.environ.get("RANK", "0")) == 0:
        world = os.environ.get("WORLD_SIZE", "1")
        where = f"resuming from the checkpoint of step {step}" if step is not None else "no checkpoint yet: from step 0"
        where += f" on {world} rank{'s' if world != '1' else ''}"
        print(f"fullshard train: restart {restart} after a failed rank: {where}", file=sys.stderr, flush=True)
    return dataclasses.replace(config, resume=step is not None)


def init_process_group(backend: str) -> None:
    """torchrun's group; after a restart, under keys of this attempt's own: the agent's store keeps
    the failed attempt's, and the ranks would read their predecessors' gloo addresses and fail."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0:
        dist.init_process_group(backend)
        return
    store, rank, world_size = next(dist.rendezvous("env://"))
    store = dist.PrefixStore(f"fullshard/attempt{restart}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


@record
def main() -> None:
    config = after_restart(TrainConfig.from_json(sys.argv[1]))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(config.threads or max(1, (os.cpu_count() or 1) // local_ranks))
    init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        result = train(config)
    except CheckpointError as exc:
        if config.debug:
            raise
        if dist.get_rank() == 0:
            print(f"fullshard train: {first_line(str(exc))} (--debug shows the traceback)", file=sys.stderr)
        sys.exit(2)
    finally:
        # The model, its units and their meshes are garbage in reference cycles now: collect
        # them while the groups they hold are still valid, not in the interpreter's teardown.
        gc.collect()
        dist.destroy_process_group()
    if result.interrupted:
        sys.exit(130)  # the shell's code for "stopped by Ctrl-C"


def first_line(text: str) -> str:
    """A checkpoint error's cause in one line: DCP's message carries every rank's traceback; the line
    that names the piece (``size mismatch for ...``) is kept."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    cause = next((line for line in lines if "size mismatch" in line or "Missing key" in line), None)
    head = lines[0] if lines else text
    return head if cause is None else f"{head.split(':')[0]}: {cause}"


if __name__ == "__main__":
    main()
