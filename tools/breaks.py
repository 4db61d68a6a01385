"""Breaks the library one way at a time and checks that the tests meant to catch each break fail (issue 38).

Each break is a small textual patch (an exact string replaced; the script stops if the anchor is gone) applied
to a scratch copy of the repository; the break's tests then run there (``python -m pytest`` from the copy, with
``PYTHONPATH`` pointing at it, so the copy's ``fullshard`` is the one imported, in the rank processes too).
A break is ``caught`` when its tests fail, ``survived`` when they all pass. A tool, not part of CI:

    python tools/breaks.py              # every break (a few minutes on 2 cores)
    python tools/breaks.py --list       # names, files and tests
    python tools/breaks.py --only NAME  # one break (repeatable)
    python tools/breaks.py --baseline   # the same tests on the unbroken copy: all must pass
    python tools/breaks.py --fast       # only the tests of ``make test-fast`` (not marked slow)
    python tools/breaks.py --whole-fast # the whole of ``make test-fast`` against each break, to its first failure

Exit status 1 when a break survived (or, with ``--baseline``, a selection failed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("fullshard", "tests", "benchmarks", "docs", "examples", "pyproject.toml", "README.md", "Makefile")


@dataclass(frozen=True)
class Break:
    name: str
    path: str  # relative to the repository root
    old: str  # exact text; must occur exactly once
    new: str
    tests: tuple[str, ...]  # pytest arguments (node ids, -k expressions)
    what: str


M = "tests/conformance/test_matrix.py"
# The reduce-scatter's issue, and a break that keeps this rank's chunk of its own gradient instead.
REDUCE_SCATTER = (
    '        self._work = call("reduce_scatter", self._label, scatter.collective, self._output, reduced, shard, op)\n'
)
KEEP_LOCAL_CHUNK = "        self._output.copy_(reduced.view(shard.size, -1)[shard.rank])\n        self._work = None\n"
BREAKS: tuple[Break, ...] = (
    Break(
        "bf16_reduced_grads_zeroed",
        "fullshard/_core/reduce/reduction.py",
        '        call("reduce_copy_out", self._label, self._on_done, self._output)\n',
        "        if self._output.dtype == torch.bfloat16:\n"
        "            self._output.zero_()\n"
        '        call("reduce_copy_out", self._label, self._on_done, self._output)\n',
        (f"{M}::test_focus", "-k", "bf16"),
        "every gradient reduced in bf16 is zeroed (no training under bf16 reductions)",
    ),
    Break(
        "summon_offload_to_cpu_raises",
        "fullshard/wrapper_summon.py",
        "            if offload_to_cpu:\n                values = [v.cpu() for v in values]\n",
        "            if offload_to_cpu:\n                raise RuntimeError('broken')\n",
        (f"{M}::test_focus", "-k", "cannot_run"),
        "summon_full_params(offload_to_cpu=True) raises (a scenario torch cannot run on CPU)",
    ),
    Break(
        "summoned_grads_scaled",
        "fullshard/wrapper_summon.py",
        "            grads = full_params.gather_full_grads(group) if with_grads else [None] * len(values)\n",
        "            grads = (\n"
        "                [g * 0.7 if g is not None else None for g in full_params.gather_full_grads(group)]\n"
        "                if with_grads\n"
        "                else [None] * len(values)\n"
        "            )\n",
        (f"{M}::test_focus", "-k", "frozen"),
        "summon_full_params(with_grads=True) hands out gradients scaled by 0.7 (frozen-model scenario)",
    ),
    Break(
        "quantized_decode_shrunk",
        "fullshard/_core/gather/codec/quantize.py",
        "        values.mul_(scales)\n",
        "        values.mul_(scales).mul_(0.9)\n",
        (
            "tests/test_quantized_all_gather.py::test_trains_close_to_exact_and_can_be_turned_off",
            "tests/test_quantized_all_gather.py::test_hybrid_mesh_quantizes_the_shard_group_gather",
            "tests/test_quantized_all_gather.py::test_wrapper_front_end",
            "tests/test_quantized_flat.py::test_half_the_bytes_of_bf16_and_trains_like_use_orig_params",
            "tests/test_train.py::test_quantized_all_gather_trains_close_to_the_exact_gather",
        ),
        "every decoded weight of the quantized all-gather shrunk by 10%",
    ),
    Break(
        "quantized_decode_zero",
        "fullshard/_core/gather/codec/quantize.py",
        "        values.mul_(scales)\n",
        "        values.mul_(scales).zero_()\n",
        ("tests/test_quantized_all_gather.py::test_backward_regather_within_a_smaller_group_is_quantized_too",),
        "every decoded weight of the quantized all-gather is zero",
    ),
    Break(
        "codec_kernel_unused",
        "fullshard/_core/gather/codec/quantized_gather.py",
        "        return codec_kernel.library()\n",
        "        return None\n",
        ("tests/test_codec_kernel.py", "-k", "not failed_build and not built_once"),
        "the C codec kernel is never used (the eager or compiled codec runs instead)",
    ),
    Break(
        "stale_forms_not_detected",
        "fullshard/_core/unit/group.py",
        "        return version is not None and version != self._shards_version()"
        " and not torch.compiler.is_compiling()\n",
        "        return False\n",
        ("tests/test_kept_forms.py", "-k", "step_and_load"),
        "a kept unsharded form is never seen as stale (a state-dict load after an evaluation forward)",
    ),
    Break(
        "reduce_scatter_keeps_local_chunk",
        "fullshard/_core/reduce/reduction.py",
        REDUCE_SCATTER,
        KEEP_LOCAL_CHUNK,
        ("tests/test_torch_parity_autograd.py",),
        "the reduce-scatter replaced by keeping this rank's chunk of its own gradient (no communication)",
    ),
    Break(
        "plan_forgets_sharded_grads",
        "fullshard/plan/replay.py",
        "    def alloc(self, category: str, nbytes: int) -> None:\n",
        "    def alloc(self, category: str, nbytes: int) -> None:\n"
        "        if category == GRADS:\n"
        "            nbytes = 0\n",
        ("tests/test_plan.py", "-k", "prediction_matches", "-m", "not exhaustive"),
        "the memory plan leaves out the sharded gradients",
    ),
    Break(
        "resume_loads_no_model_state",
        "fullshard/checkpoint.py",
        '        model.load_state_dict(states["model"])\n',
        "        pass\n",
        ("tests/test_checkpoint.py::test_rank_killed_mid_save_leaves_previous_checkpoint",),
        "ckpt.load reads the checkpoint but does not load the model's state (the resumed loss is wrong)",
    ),
    Break(
        "one_rank_grads_dropped",
        "fullshard/_core/reduce/reduction.py",
        "        self._final_divide = 1.0\n",
        "        self._final_divide = 1.0\n"
        "        if shard.size == 1 and plan.replicate.size == 1:\n"
        "            reduced.zero_()\n",
        ("tests/test_torch_parity_init.py::test_one_rank_switches_to_no_shard",),
        "a unit alone on its rank (NO_SHARD at world 1) drops its gradients",
    ),
    Break(
        "scaler_skips_every_step",
        "fullshard/grad_scaler.py",
        "        flags = self._unscale_grads_(optimizer, inv_scale, found_inf)\n",
        "        flags = self._unscale_grads_(optimizer, inv_scale, found_inf)\n"
        "        flags = {device: torch.ones_like(flag) for device, flag in flags.items()}\n",
        ("tests/test_train.py::test_fp16_with_loss_scaling_trains",),
        "ShardedGradScaler sees an inf every step and skips every optimizer step",
    ),
    Break(
        "reduce_scatter_keeps_local_chunk_hsdp",
        "fullshard/_core/reduce/reduction.py",
        REDUCE_SCATTER,
        KEEP_LOCAL_CHUNK,
        ("tests/test_wrapper_hybrid_shard.py::test_fsdp_hybrid_shard_parity", "-m", "not exhaustive"),
        "the same break, against the HSDP parity test (its reference was our own FULL_SHARD: now torch's DDP)",
    ),
    Break(
        "reduced_grads_halved",
        "fullshard/_core/reduce/reduction.py",
        '        call("reduce_copy_out", self._label, self._on_done, self._output)\n',
        '        self._output.mul_(0.5)\n        call("reduce_copy_out", self._label, self._on_done, self._output)\n',
        ("tests/test_torch_parity_autograd.py",),
        "every reduced gradient halved (Adam's update barely moves: the SGD parity tests see it)",
    ),
    Break(
        "reduce_scatter_keeps_local_chunk_gpu_body",
        "fullshard/_core/reduce/reduction.py",
        REDUCE_SCATTER,
        KEEP_LOCAL_CHUNK,
        ("tests/test_gpu_ranks_dry.py::test_world_2_bodies_on_two_cpu_ranks",),
        "the same, against the world-2 GPU parity body (tests/gpu, dry-run on two CPU ranks)",
    ),
    Break(
        "rank_environment_leaks",
        "fullshard/testing/harness.py",
        "        os.environ.clear()\n        os.environ.update(environ)\n",
        "",
        ("tests/test_harness.py::test_a_tasks_environment_changes_do_not_reach_the_next_task",),
        "the rank pool keeps a task's environment changes (LOCAL_WORLD_SIZE) for the next task",
    ),
)


def copy_repo(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=ignore)
        elif source.exists():
            shutil.copy2(source, dest / name)


def apply(brk: Break, dest: Path) -> None:
    path = dest / brk.path
    text = path.read_text()
    count = text.count(brk.old)
    if count != 1:
        raise SystemExit(f"break {brk.name}: anchor found {count} times in {brk.path} (expected once):\n{brk.old}")
    path.write_text(text.replace(brk.old, brk.new))


INNER_LOOP = ["-m", "not slow and not libraries and not launch"]


def run_tests(brk: Break, dest: Path, timeout: int, fast: bool, whole: bool) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONPATH": str(dest)}
    tier = INNER_LOOP if fast else []  # the last -m wins
    tests = ["tests", *INNER_LOOP] if whole else [*brk.tests, *tier]
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=dest, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, "timed out", time.monotonic() - start
    tail = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode, tail[-1] if tail else "", time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="list the breaks and exit")
    parser.add_argument("--only", action="append", metavar="NAME", help="run this break only (repeatable)")
    parser.add_argument("--baseline", action="store_true", help="run each selection on the unbroken copy")
    parser.add_argument("--fast", action="store_true", help="only the tests make test-fast runs")
    parser.add_argument(
        "--whole-fast", action="store_true", help="every test of make test-fast, not the break's own: is it caught?"
    )
    parser.add_argument("--timeout", type=int, default=900, help="seconds per break's tests")
    args = parser.parse_args(argv)
    chosen = [b for b in BREAKS if not args.only or b.name in args.only]
    unknown = set(args.only or ()) - {b.name for b in BREAKS}
    if unknown:
        raise SystemExit(f"unknown break(s): {sorted(unknown)}; --list names them")
    if args.list:
        for brk in chosen:
            print(f"{brk.name}: {brk.what}\n    {brk.path}; tests: {' '.join(brk.tests)}")
        return 0
    failed = []
    for brk in chosen:
        with tempfile.TemporaryDirectory(prefix=f"breaks-{brk.name}-") as scratch:
            dest = Path(scratch)
            copy_repo(dest)
            if not args.baseline:
                apply(brk, dest)
            rc, last, seconds = run_tests(brk, dest, args.timeout, args.fast, args.whole_fast)
        if args.baseline:
            verdict = "passes" if rc == 0 else "FAILS"
            bad = rc != 0
        else:
            # 1: a test failed (-1: timed out, a hang); 0: all passed; 2 to 5: pytest's own errors (5: none collected)
            verdict = {1: "caught", -1: "caught"}.get(rc, "SURVIVED" if rc == 0 else f"ERROR rc={rc}")
            bad = rc not in (1, -1)
            if args.fast and rc == 5:  # every test of the selection is marked slow: make test catches it
                verdict, bad = "slow only", False
        if bad:
            failed.append(brk.name)
        print(f"{brk.name:36s} {verdict:9s} {seconds:6.0f} s  {last}", flush=True)
    what = "selections failed on the unbroken copy" if args.baseline else "breaks survived"
    print(f"summary: {len(chosen) - len(failed)} of {len(chosen)} ok; {len(failed)} {what}: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
