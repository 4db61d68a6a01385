"""tests/UPSTREAM.md stays a complete map of torch's own FSDP test suite (issue 35).

The inventory lists every test of torch's FSDP test files, one table row each, with a status:
``ours:`` (tests of ours asserting the same behaviour), ``n/a:`` (why it does not apply here),
``diff:`` (a deliberate difference documented in ``docs/api.md``) or ``gap:`` (behaviour we do not
test yet). This test fails on a row without a status, on an ``ours:`` reference to a test file or
function that does not exist, on a ``diff:`` without a resolving link into ``docs/api.md``, and on
counts or a work queue that disagree with the tables. Gaps do not fail it: they are the work queue
at the top of the file, and their number is printed.

No ranks, no torch import: it parses Markdown and our test files' source.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
INVENTORY = ROOT / "tests" / "UPSTREAM.md"
API_DOC = ROOT / "docs" / "api.md"

STATUSES = ("ours", "n/a", "diff", "gap")
FILE_HEADING = re.compile(r"^## `(test/distributed/\S+\.py)`")
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|(.*)\|\s*$")
OURS_REF = re.compile(r"tests/([\w/]+\.py)::(\w+)")
API_LINK = re.compile(r"\(\.\./docs/api\.md#([\w-]+)\)")
COUNTS = re.compile(r"^Counted: (\d+) files, (\d+) tests\.", re.M)
QUEUE_ITEM = re.compile(r"^- `(test/distributed/\S+\.py)` `([^`]+)`", re.M)


class Row(NamedTuple):
    file: str  # the upstream test file
    test: str  # Class.test_method (or a module-level test function)
    behaviour: str
    status: str  # the whole status cell
    line: int


def parse(text: str) -> list[Row]:
    """Every table row under a ``## `test/distributed/...py``` heading."""
    rows, file = [], None
    for num, line in enumerate(text.splitlines(), 1):
        heading = FILE_HEADING.match(line)
        if heading:
            file = heading.group(1)
            continue
        if line.startswith("## "):
            file = None
            continue
        row = ROW.match(line)
        if file is None or row is None:
            continue
        cells = [c.strip() for c in row.group(2).split("|")]
        if len(cells) < 2:
            cells += [""] * (2 - len(cells))
        rows.append(Row(file, row.group(1), cells[0], " | ".join(cells[1:]), num))
    return rows


def status_of(row: Row) -> str | None:
    for status in STATUSES:
        if row.status.startswith(status + ":") and row.status[len(status) + 1 :].strip():
            return status
    return None


@cache
def functions_in(path: str) -> frozenset[str]:
    """Names of the ``def test_*`` in one of our test files (empty if there is no such file)."""
    source = ROOT / "tests" / path
    if not source.is_file():
        return frozenset()
    tree = ast.parse(source.read_text())
    return frozenset(
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
    )


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@cache
def api_anchors() -> frozenset[str]:
    headings = re.findall(r"^#+ (.+)$", API_DOC.read_text(), re.M)
    return frozenset(slug(h) for h in headings)


def problems(rows: list[Row]) -> list[str]:
    found, seen = [], set()
    for row in rows:
        where = f"UPSTREAM.md:{row.line} {row.file} {row.test}"
        if (row.file, row.test) in seen:
            found.append(f"{where}: listed twice")
        seen.add((row.file, row.test))
        if not row.behaviour:
            found.append(f"{where}: no behaviour")
        status = status_of(row)
        if status is None:
            found.append(f"{where}: no status (ours: / n/a: / diff: / gap: with text)")
        elif status == "ours":
            refs = OURS_REF.findall(row.status)
            if not refs:
                found.append(f"{where}: ours: names no tests/<file>.py::<test>")
            for path, name in refs:
                if not (ROOT / "tests" / path).is_file():
                    found.append(f"{where}: no test file tests/{path}")
                elif name not in functions_in(path):
                    found.append(f"{where}: tests/{path} has no def {name}")
        elif status == "diff":
            anchors = API_LINK.findall(row.status)
            if not anchors:
                found.append(f"{where}: diff: has no link to ../docs/api.md#...")
            found += [f"{where}: docs/api.md has no #{a}" for a in anchors if a not in api_anchors()]
    return found


def test_every_upstream_test_has_a_status_and_real_references():
    text = INVENTORY.read_text()
    rows = parse(text)
    assert rows, "no rows parsed from tests/UPSTREAM.md"
    found = problems(rows)
    assert not found, "\n".join(found)


def test_counts_and_work_queue_agree_with_the_tables():
    text = INVENTORY.read_text()
    rows = parse(text)
    counts = COUNTS.search(text)
    assert counts, "UPSTREAM.md needs a line 'Counted: N files, M tests.'"
    files = {row.file for row in rows}
    assert (int(counts.group(1)), int(counts.group(2))) == (len(files), len(rows))
    headings = [m.group(1) for m in map(FILE_HEADING.match, text.splitlines()) if m]
    assert len(headings) == len(set(headings)), "a file has two sections"
    assert set(headings) == files, f"sections without rows: {set(headings) - files}"
    gaps = {(row.file, row.test) for row in rows if status_of(row) == "gap"}
    queue = set(QUEUE_ITEM.findall(text))
    assert queue == gaps, (
        f"work queue lacks {sorted(gaps - queue)}; lists non-gaps {sorted(queue - gaps)}"
    )
    by_status = {s: sum(status_of(r) == s for r in rows) for s in STATUSES}
    print(f"upstream inventory: {len(files)} files, {len(rows)} tests: {by_status}")
    print(f"gaps (the work queue at the top of tests/UPSTREAM.md): {by_status['gap']}")


def test_checker_catches_bad_rows():
    sample = "\n".join(
        [
            "## `test/distributed/fsdp/test_x.py` (read at abc)",
            "| upstream test | behaviour | status |",
            "|---|---|---|",
            "| `A.test_ok` | trains | ours: tests/test_upstream_inventory.py::test_checker_catches_bad_rows |",
            "| `A.test_none` | trains |  |",
            "| `A.test_bad_fn` | trains | ours: tests/test_upstream_inventory.py::test_nope |",
            "| `A.test_bad_file` | trains | ours: tests/test_nope.py::test_x |",
            "| `A.test_diff` | trains | diff: no link |",
            "| `A.test_diff_anchor` | trains | diff: see [x](../docs/api.md#no-such-heading) |",
            "| `A.test_gap` | trains | gap: nothing yet |",
            "| `A.test_na` | trains | n/a: CUDA only |",
            "| `A.test_empty_gap` | trains | gap: |",
        ]
    )
    rows = parse(sample)
    assert [r.test for r in rows][0] == "A.test_ok" and len(rows) == 9
    bad = {p.split()[2].rstrip(":") for p in problems(rows)}
    assert bad == {
        "A.test_none",
        "A.test_bad_fn",
        "A.test_bad_file",
        "A.test_diff",
        "A.test_diff_anchor",
        "A.test_empty_gap",
    }
