"""Mutation run over the engine's value paths (issue 38, item 3).

A mutant is one small change to one function of a target file (an operator swapped, a comparison
moved or flipped, a number off by one, True and False swapped, ``and`` / ``or`` swapped, a ``not``
dropped, a call statement or an augmented assignment dropped). Each mutant is written into one scratch
copy of the repository, the target's tests run there (``-x``, under a timeout, with ``PYTHONPATH`` at
the copy so the rank processes import the mutated ``fullshard`` too), and the file is put back. A mutant
is ``killed`` when a test fails or the run times out (a hang), ``survived`` when every test passes,
``equivalent`` when it survived and ``EQUIVALENT`` gives the reason no test can see it.

Which mutants run is decided once: every mutant of every target function, in source order, then each
target's ``sample`` of them drawn with a fixed seed, so two runs on the same tree pick the same ones.
A benchmark tool, not part of CI:

    python tools/mutants.py --list                 # the chosen mutants (id, file, line, change)
    python tools/mutants.py --baseline             # each target's tests on the unmutated copy, timed
    python tools/mutants.py --out results.jsonl    # the run (appends; --resume skips ids already there)
    python tools/mutants.py --only ID              # one mutant (repeatable), its tests' output shown
    python tools/mutants.py --report results.jsonl # the score and the survivors of a finished run

Exit status 1 when a mutant survived that ``EQUIVALENT`` does not explain.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("fullshard", "tests", "pyproject.toml")
SEED = 38
FAST = ("-m", "not slow and not libraries and not launch")  # the tier make test-fast runs: every selection's


@dataclass(frozen=True)
class Target:
    path: str  # relative to the repository root
    functions: tuple[str, ...]  # qualified names; a class name covers its methods
    tests: tuple[str, ...]  # pytest arguments, cheapest and most telling first (-x stops at the first failure)
    sample: int  # how many of the file's mutants run
    timeout: int = 420  # seconds for one mutant's tests (a loaded machine; a hang counts as killed)


# The value paths and the tests that cover them: the one list to update when files move. Each selection
# is narrow (a mutant's run is as long as its tests when it survives) and starts with NEW, the tests
# written for this run's survivors (left out with --before: the score of the suite as it was).
NEW = "tests/test_mutants_values.py"
AUTOGRAD = "tests/test_torch_parity_autograd.py"
SD_MODEL = "tests/test_state_dict_model.py"
# Gather extensions (fsdp_pre_all_gather): left out of the first run's all_gather.py and layout.py
# selections (float8's one-byte inputs are the byte layout's only odd-sized regions).
FLOAT8 = "tests/test_tensor_subclass_params.py::test_float8_all_gather_sends_fp8_bytes_and_trains_as_torch_fsdp2"
SUBCLASS = (
    "tests/test_tensor_subclass_params.py::test_toy_subclass_both_hook_signatures_gather_bf16_and_train_as_torch_fsdp2"
)
SD_OPTIM = "tests/test_state_dict_optim.py"
TARGETS: tuple[Target, ...] = (
    Target(
        "fullshard/_core/reduce/reduction.py",
        ("_averaging", "_split_factor", "chunk_cat", "_splits_evenly", "flat_cat", "split_reduced", "GradReduction"),
        (NEW, AUTOGRAD, "tests/test_reduction_spare.py"),
        10,
    ),
    Target(
        "fullshard/_core/gather/all_gather.py",
        (
            "CopyOutTargets",
            "split_views",
            "AllGather.input",
            "AllGather.copy_in",
            "AllGather._codec_casts",
            "AllGather._input_with_extensions",
            "AllGather.start",
            "AllGather._issue",
            "AllGather.copy_out",
            "AllGather._plain_targets",
            "AllGather.keep_post_forward",
        ),
        (NEW, AUTOGRAD, "tests/test_copy_out_targets.py", SUBCLASS),
        7,
    ),
    Target(
        "fullshard/_core/layout.py",
        ("Layout", "flat_pieces"),
        (NEW, AUTOGRAD, "tests/test_kept_forms.py::test_wrapper_evaluation_forward_before_step", FLOAT8),
        5,
    ),
    Target(
        "fullshard/_core/gather/codec/quantize.py",
        (
            "BlockQuantizer.num_blocks",
            "BlockQuantizer.packed_numel",
            "BlockQuantizer.encode",
            "BlockQuantizer.decode",
            "_codes_to_fp32",
            "_code_values",
        ),
        (NEW, "tests/test_quantize.py"),
        5,
    ),
    Target(
        "fullshard/_core/gather/codec/quantized_gather.py",
        ("QuantizedGather",),
        (NEW, "tests/test_quantize.py", "tests/test_codec_kernel.py::test_one_decode_call_for_every_ranks_flat_piece"),
        5,
    ),
    Target(
        "fullshard/_core/unit/group.py",
        ("ParamGroup",),  # the forms (ParamForms in the run recorded in RESULTS.md) merged into it (issue 34)
        (NEW, AUTOGRAD, "tests/test_kept_forms.py"),
        6,
    ),
    Target(
        "fullshard/_core/reduce/reduction.py",  # grads.py merged into it (issue 34)
        ("per_param", "GradIntake", "_pop_unsharded_grad", "_local_grad"),
        (NEW, AUTOGRAD),
        6,
    ),
    Target(
        "fullshard/_core/unit/full_params.py",
        (
            "gather_full_values",
            "gather_full_grads",
            "gather_like_shards",
            "_grads_in_storage_layout",
            "write_back",
            "write_shard",
            "local_part",
            "row_shard",
        ),
        (NEW, SD_MODEL),
        5,
    ),
    Target(
        "fullshard/state_dict/model.py",
        ("_save_params", "_gathered", "_save_buffers_in_original_dtype", "_load_params"),
        (NEW, SD_MODEL),
        4,
    ),
    Target(
        "fullshard/state_dict/sharded_tensor.py",
        (
            "as_sharded_tensor",
            "sharded_tensor",
            "shard_entry",
            "as_fsdp1_optim_state",
            "_chunk_metadata",
            "loadable",
            "_same_layout",
            "same_shards",
            "full_tensor",
        ),
        (NEW, SD_MODEL, SD_OPTIM),
        4,
    ),
    Target(
        "fullshard/state_dict/optim.py",
        (
            "_param_entries",
            "_in_model_order",
            "optim_state_dict",
            "_gather_flat_states",
            "_split_state",
            "optim_state_dict_to_load",
            "optim_state_dict_for_params",
            "_join_state",
            "_like",
        ),
        (NEW, SD_OPTIM),
        5,
    ),
    Target(
        "fullshard/wrapper_optim_state.py",
        (
            "optim_state_dict",
            "optim_state_dict_to_load",
            "full_optim_state_dict",
            "sharded_optim_state_dict",
            "shard_full_optim_state_dict",
            "scatter_full_optim_state_dict",
            "flatten_sharded_optim_state_dict",
            "rekey_optim_state_dict",
            "_param_groups",
        ),
        (NEW, SD_OPTIM),
        3,
    ),
)

# Survivors no test can tell apart from the original, by id (see --list), with the reason.
EQUIVALENT: dict[str, str] = {
    "94bc7430": "_averaging's sum_only default True: its one caller always passes sum_only, the default is"
    " never used (and summing then dividing is what AVG computes)",
    "8bf2e2d1": "_wait divides when nothing is in flight too: every stage popped issues a collective (the comm"
    " hook's stage sets no divisor), so _wait never runs idle once a divisor is set",
    "d1066b08": "CopyOutTargets.serves skips the per-parameter check: a parameter gets a new padded tensor only"
    " through forget_unsharded (rebind: a new storage layout), a dtype change (a new gather layout) or"
    " aliasing (a shard group of one: no gather), so the one cached target always fails the layout check first",
    "42666a81": "a zero block's scale 2.0 instead of 1.0: its codes are all zero, which decode to zero whatever"
    " the scale",
    "eee321c5": "int8 codes on the CPU go through the lookup table of their 256 values, exact as the direct"
    " copy (equivalent on the CPU; on a GPU float8 codes would index a CPU table: tests/gpu has no"
    " quantized-gather test to see it)",
    "0fdb965a": "no fused codec for coded regions: the eager codec runs instead and gives the same bits (the"
    " fused codec is a speed path; tests/test_quantize_fused.py, which compiles, counts its use)",
    "17cb764f": "Layout.tiles says True for a flat layout: both readers (copy_out, _plain_targets) take the"
    " flat layout's own path before they ask whether the regions tile",
    "51036264": "rank_layouts' invariant check weakened: a misuse (no pieces under a flat layout) raises a"
    " TypeError instead of the AssertionError; no correct call reaches it",
    "9f1fff4f": "accumulate_unsynced moves an fp32 gradient to the unsynced sum where the original leaves it on"
    " .grad (and the reverse): take() adds the two either way, the same values",
}


@dataclass(frozen=True)
class Mutant:
    id: str  # a hash of (path, function, change, occurrence): stable while the function's text is
    path: str
    function: str
    line: int
    change: str  # "old -> new", as source text
    start: int  # byte offsets of the replaced source
    end: int
    replacement: str


_BINOPS = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv,
}
_COMPARES = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_SKIPPED = (ast.Raise, ast.Assert, ast.JoinedStr, ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal)


def _variants(node: ast.AST) -> Iterator[ast.AST | None]:
    """The mutated copies of ``node`` (None: the statement dropped)."""
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        yield ast.BinOp(node.left, _BINOPS[type(node.op)](), node.right)
    elif isinstance(node, ast.AugAssign):
        yield None
        if type(node.op) in _BINOPS:
            yield ast.AugAssign(node.target, _BINOPS[type(node.op)](), node.value)
    elif isinstance(node, ast.Compare):
        for index, op in enumerate(node.ops):
            if type(op) in _COMPARES:
                ops = list(node.ops)
                ops[index] = _COMPARES[type(op)]()
                yield ast.Compare(node.left, ops, node.comparators)
    elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
        yield ast.Constant(not node.value)
    elif isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        yield ast.Constant(node.value + 1)
    elif isinstance(node, ast.BoolOp):
        yield ast.BoolOp(ast.Or() if isinstance(node.op, ast.And) else ast.And(), node.values)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield node.operand
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        yield None


def _walk(node: ast.AST) -> Iterator[ast.AST]:
    """``node``'s descendants in source order, leaving out what is not a value path: error
    and assertion statements, messages, annotations, decorators, docstrings."""
    for name, value in ast.iter_fields(node):
        if name in ("annotation", "returns", "decorator_list", "type_comment"):
            continue
        for child in value if isinstance(value, list) else [value]:
            if not isinstance(child, ast.AST) or isinstance(child, _SKIPPED):
                continue
            if isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant):
                continue  # a docstring
            yield child
            yield from _walk(child)


def _functions(tree: ast.Module, wanted: tuple[str, ...]) -> Iterator[tuple[str, ast.AST]]:
    """(qualified name, node) of every function of ``tree`` that ``wanted`` names or lies in."""

    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if isinstance(child, ast.ClassDef):
                    yield from visit(child, f"{name}.")
                elif any(name == w or name.startswith(f"{w}.") for w in wanted):
                    yield name, child

    found = list(visit(tree, ""))
    missing = [w for w in wanted if not any(n == w or n.startswith(f"{w}.") for n, _ in found)]
    if missing:
        raise SystemExit(f"mutants: {missing} not found as functions or classes in the target file (moved?)")
    return iter(found)


def _offsets(source: bytes) -> list[int]:
    starts = [0]
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts


def _replace(parent: ast.AST, old: ast.AST, new: ast.AST | None) -> None:
    """Puts ``new`` where ``old`` is among ``parent``'s fields (a dropped statement becomes ``pass``)."""
    for name, value in ast.iter_fields(parent):
        if value is old:
            setattr(parent, name, new)
            return
        if isinstance(value, list) and any(v is old for v in value):
            value[:] = [(new or ast.Pass()) if v is old else v for v in value]
            return
    raise AssertionError(f"{ast.dump(old)} not a child of {ast.dump(parent)}")


def _restore(parent: ast.AST, fields: dict[str, object]) -> None:
    for name, value in fields.items():
        setattr(parent, name, value)


def mutants_of(target: Target) -> list[Mutant]:
    """Every mutant of ``target``'s functions, in source order, each checked to parse into
    exactly the tree it means (else its replacement is parenthesised, or it is left out)."""
    source = (ROOT / target.path).read_bytes()
    tree = ast.parse(source)
    starts = _offsets(source)
    parents = {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    found: list[Mutant] = []
    seen: dict[str, int] = {}
    for qualname, function in _functions(tree, target.functions):
        for node in _walk(function):
            for variant in _variants(node):
                start = starts[node.lineno - 1] + node.col_offset
                end = starts[node.end_lineno - 1] + node.end_col_offset
                old = source[start:end].decode()
                text = "pass" if variant is None else ast.unparse(variant)
                mutated = _checked(tree, parents[id(node)], node, variant, source, start, end, text)
                if mutated is None:
                    continue
                change = f"{' '.join(old.split())} -> {text}"
                key = f"{target.path}|{qualname}|{change}"
                seen[key] = seen.get(key, -1) + 1
                digest = hashlib.sha1(f"{key}|{seen[key]}".encode()).hexdigest()[:8]
                found.append(Mutant(digest, target.path, qualname, node.lineno, change, start, end, mutated))
    return found


def _checked(
    tree: ast.Module,
    parent: ast.AST,
    node: ast.AST,
    variant: ast.AST | None,
    source: bytes,
    start: int,
    end: int,
    text: str,
) -> str | None:
    """``text`` (or ``(text)``) when splicing it in gives the mutated tree; None when neither does."""
    fields = {name: list(value) if isinstance(value, list) else value for name, value in ast.iter_fields(parent)}
    _replace(parent, node, variant)
    try:
        wanted = ast.dump(tree)
    finally:
        _restore(parent, fields)
    for candidate in (text, f"({text})"):
        try:
            spliced = ast.parse(source[:start] + candidate.encode() + source[end:])
        except SyntaxError:
            continue
        if ast.dump(spliced) == wanted:
            return candidate
    return None


def chosen(targets: tuple[Target, ...] = TARGETS) -> list[Mutant]:
    """Each target's ``sample`` of its mutants, drawn with ``SEED``, in source order."""
    picked = []
    for target in targets:
        every = mutants_of(target)
        order = list(range(len(every)))
        random.Random(f"{SEED}|{target.path}").shuffle(order)  # a smaller sample is a prefix: --resume keeps it
        indices = sorted(order[: target.sample])
        picked += [every[i] for i in indices]
    return picked


def copy_repo(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "*.so")
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=ignore)
        else:
            shutil.copy2(source, dest / name)


def run_tests(target: Target, dest: Path, timeout: int, before: bool, quiet: bool = True) -> tuple[int, str, float]:
    """(return code, last line, seconds) of ``target``'s tests in ``dest``; -1: timed out.
    The tests run in their own session, killed whole on a timeout (the rank pool included)."""
    env = {**os.environ, "PYTHONPATH": str(dest), "PYTHONDONTWRITEBYTECODE": "1"}
    tests = [t for t in target.tests if not (before and t == NEW)]
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests, *FAST]
    start = time.monotonic()
    process = subprocess.Popen(
        cmd, cwd=dest, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return -1, "timed out", time.monotonic() - start
    except BaseException:  # interrupted: no rank process outlives the run
        os.killpg(process.pid, signal.SIGKILL)
        raise
    if not quiet:
        print(output)
    lines = output.strip().splitlines()
    failed = [line.split(" - ")[0] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    last = lines[-1] if lines else ""
    return process.returncode, f"{last} ({failed[0]})" if failed else last, time.monotonic() - start


def verdict(rc: int) -> str:
    # 1: a test failed; -1: timed out (a hang); 2: interrupted (an import or collection error); 0: all passed
    return {0: "survived", 1: "killed", -1: "killed", 2: "killed"}.get(rc, f"error rc={rc}")


def _target_of(mutant: Mutant) -> Target:
    return next(t for t in TARGETS if t.path == mutant.path)


def _line(mutant: Mutant) -> str:
    return f"{mutant.id}  {mutant.path}:{mutant.line}  {mutant.function}: {mutant.change}"


def report(path: Path) -> int:
    """Prints the score of the run recorded in ``path`` and its survivors; 1 if one is unexplained."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    latest = {r["id"]: r for r in records}
    killed = [r for r in latest.values() if r["verdict"] == "killed"]
    survived = [r for r in latest.values() if r["verdict"] == "survived"]
    explained = [r for r in survived if r["id"] in EQUIVALENT]
    other = [r for r in latest.values() if r["verdict"] not in ("killed", "survived")]
    total = len(latest) - len(other)
    print(
        f"{len(latest)} mutants: {len(killed)} killed, {len(survived)} survived ({len(explained)} equivalent),"
        f" {len(other)} errors; score {len(killed)}/{total} = {100 * len(killed) / max(total, 1):.1f}%,"
        f" {100 * (len(killed) + len(explained)) / max(total, 1):.1f}% with the equivalent ones"
    )
    for record in survived:
        reason = EQUIVALENT.get(record["id"], "SURVIVED")
        print(
            f"  {record['id']}  {record['path']}:{record['line']}  {record['function']}: {record['change']}"
            f"\n      {reason}"
        )
    for record in other:
        print(f"  {record['id']}  {record['verdict']}  {record['last']}")
    return 1 if len(survived) > len(explained) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="list the chosen mutants and exit")
    parser.add_argument("--all", action="store_true", help="with --list: every mutant, not the sample")
    parser.add_argument("--baseline", action="store_true", help="run each target's tests unmutated, timed")
    parser.add_argument("--before", action="store_true", help=f"without {NEW} (the suite before this run)")
    parser.add_argument("--only", action="append", metavar="ID", help="run this mutant only (repeatable)")
    parser.add_argument("--target", action="append", metavar="PATH", help="only this target file (repeatable)")
    parser.add_argument("--out", type=Path, help="append one JSON line per mutant here")
    parser.add_argument("--resume", action="store_true", help="skip the mutants --out already holds")
    parser.add_argument("--report", type=Path, metavar="JSONL", help="print a finished run's score and exit")
    args = parser.parse_args(argv)
    if args.report:
        return report(args.report)
    targets = tuple(t for t in TARGETS if not args.target or t.path in args.target)
    if args.list:
        every = [m for t in targets for m in mutants_of(t)] if args.all else chosen(targets)
        for mutant in every:
            print(_line(mutant))
        print(f"{len(every)} mutants")
        return 0
    with tempfile.TemporaryDirectory(prefix="mutants-") as scratch:
        dest = Path(scratch)
        copy_repo(dest)
        if args.baseline:
            failed = 0
            for target in targets:
                rc, last, seconds = run_tests(target, dest, 3600, args.before)
                failed += rc != 0
                print(f"{target.path:42s} {'passes' if rc == 0 else 'FAILS':7s} {seconds:6.0f} s  {last}", flush=True)
            return 1 if failed else 0
        mutants = chosen(targets)
        if args.only:
            mutants = [m for m in (m for t in targets for m in mutants_of(t)) if m.id in args.only]
        done = set()
        if args.resume and args.out and args.out.exists():
            done = {json.loads(line)["id"] for line in args.out.read_text().splitlines() if line.strip()}
        survivors = []
        for number, mutant in enumerate(mutants, 1):
            if mutant.id in done:
                continue
            path = dest / mutant.path
            original = path.read_bytes()
            path.write_bytes(original[: mutant.start] + mutant.replacement.encode() + original[mutant.end :])
            try:
                target = _target_of(mutant)
                rc, last, seconds = run_tests(target, dest, target.timeout, args.before, quiet=not args.only)
            finally:
                path.write_bytes(original)
            result = verdict(rc)
            if result == "survived" and mutant.id in EQUIVALENT:
                result = "equivalent"
            elif result == "survived":
                survivors.append(mutant)
            print(f"[{number}/{len(mutants)}] {result:10s} {seconds:5.0f} s  {_line(mutant)}", flush=True)
            if args.out:
                record = {k: v for k, v in asdict(mutant).items() if k not in ("start", "end", "replacement")}
                with args.out.open("a") as out:
                    out.write(
                        json.dumps(
                            {
                                **record,
                                "verdict": verdict(rc),
                                "before": args.before,
                                "seconds": round(seconds, 1),
                                "last": last,
                            }
                        )
                        + "\n"
                    )
    print(f"{len(survivors)} unexplained survivors")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
