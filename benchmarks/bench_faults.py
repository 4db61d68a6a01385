"""Faults: how long until every rank has exited, and what the launcher was told.

    python benchmarks/bench_faults.py                    # every fault, fullshard and FSDP2, 2 gloo ranks
    python benchmarks/bench_faults.py --faults sigkill,disagree --frameworks fullshard

Each run launches 2 ranks through torchrun (``--standalone``, as ``fullshard train``
does); the ranks build a small model of fullshard/testing/lifecycle.py, shard it
(``fully_shard`` on each block and the root), train, and at step 3 one rank meets
the fault:

- ``raise-forward`` / ``raise-backward``: rank 1 raises inside a block's forward
  (a bug in the model) or from a gradient hook in backward;
- ``oom``: rank 1 raises ``torch.OutOfMemoryError`` in forward (what an
  allocation failure raises; a CPU machine cannot run out on demand);
- ``sigkill``: rank 1 kills itself with SIGKILL right before an all-gather
  (the other rank is then inside the collective);
- ``disagree``: rank 1 builds a model with one more block than rank 0.

Reported: the seconds from launch to the last rank's exit, the exit code of
torchrun, whether the fault was named (the failing rank and the cause in the
launcher's output), and for comparison the steps before the fault (nothing
is lost beyond the step in flight: the model is in memory only). The process
group timeout is 60 s, the whole run's 150 s: a hang shows as the timeout.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

FAULTS = ("raise-forward", "raise-backward", "oom", "sigkill", "disagree")


def worker(framework: str, fault: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from fullshard.testing.lifecycle import Block

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    if framework == "fullshard":
        from fullshard import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    depth = 4 if fault == "disagree" and rank == 1 else 3
    model = torch.nn.Sequential(*(Block(16) for _ in range(depth)))
    for block in model:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(6):
        faulty = step == 3 and rank == 1
        if faulty and fault == "raise-forward":
            model[1].fail = True
        if faulty and fault == "oom":
            model[1].register_forward_pre_hook(_out_of_memory)
        if faulty and fault == "sigkill":
            model[1].register_forward_pre_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL), prepend=True)
        loss = model(torch.randn(4, 16)).sum()
        if faulty and fault == "raise-backward":
            loss.register_hook(_fail_in_backward)
        loss.backward()
        optim.step()
        optim.zero_grad()
        print(f"rank {rank} finished step {step}", flush=True)
    dist.destroy_process_group()


def _out_of_memory(*_: object) -> None:
    import torch

    raise torch.OutOfMemoryError("a simulated allocation failure")


def _fail_in_backward(grad: object) -> None:
    raise RuntimeError("a backward that fails on purpose")


def run_one(framework: str, fault: str) -> dict:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        os.path.abspath(__file__), "--worker", framework, fault,
    ]  # fmt: skip
    start = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=150)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        code, output = "timeout", (expired.stdout or b"").decode() + (expired.stderr or b"").decode()
    seconds = time.monotonic() - start
    causes = {
        "raise-forward": "a forward that fails on purpose",
        "raise-backward": "a backward that fails on purpose",
        "oom": "OutOfMemoryError",
        "sigkill": "SIGKILL",
        "disagree": "differ",
    }
    named = causes[fault] in output and ("rank 1" in output or "local_rank: 1" in output or "[1]" in output)
    steps = max((int(line.rsplit(" ", 1)[1]) for line in output.splitlines() if " finished step " in line), default=-1)
    aborted = "SIGABRT" in output or "terminate called" in output
    # The launcher's last words, for a failed check to show (an abort was seen once in CI, never here).
    tail = output[-3000:]
    return {"seconds": seconds, "code": code, "named": named, "last_step": steps, "aborted": aborted, "tail": tail}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--frameworks", default="fullshard,fsdp2")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    rows = []
    for fault in args.faults.split(","):
        for framework in args.frameworks.split(","):
            print(f"running {fault} under {framework} ...", flush=True)
            rows.append((fault, framework, run_one(framework, fault)))
    print(f"\n{'fault':15s} {'framework':10s} {'all exited (s)':>15s} {'torchrun code':>14s} "
          f"{'rank and cause named':>21s} {'gloo abort':>11s} {'last step done':>15s}")  # fmt: skip
    for fault, framework, r in rows:
        named, aborted = ("yes" if r[key] else "no" for key in ("named", "aborted"))
        print(f"{fault:15s} {framework:10s} {r['seconds']:15.1f} {r['code']!s:>14s} {named:>21s} "
              f"{aborted:>11s} {r['last_step']:15d}")  # fmt: skip


if __name__ == "__main__":
    main()
