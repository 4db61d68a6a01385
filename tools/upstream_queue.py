"""Rewrite the counts and the work queue at the top of tests/UPSTREAM.md from its tables.

    python tools/upstream_queue.py          # rewrite the block between the queue markers
    python tools/upstream_queue.py --check  # exit 1 if the block is out of date (prints the diff)

The tables are the source of truth; the block between ``<!-- queue:start -->`` and
``<!-- queue:end -->`` is derived from them, so an edited row needs only this script to keep
tests/test_upstream_inventory.py passing. A ``gap:`` whose text starts with ``values:`` could hide
a wrong value: it goes to the first list, in the order that list already has (new ones after, in
table order); every other gap goes to the second list, in table order. The queue line shows the
gap's text without the ``values:`` tag.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INVENTORY = ROOT / "tests" / "UPSTREAM.md"
sys.path.insert(0, str(ROOT / "tests"))

from test_upstream_inventory import QUEUE_ITEM, STATUSES, parse, status_of  # noqa: E402

START, END = "<!-- queue:start -->", "<!-- queue:end -->"
VALUES_TAG = "values:"
VALUES_HEADING = "### Gaps most likely to hide wrong values (work on these first)"
OTHER_HEADING = "### Other gaps (missing behaviour or contract), in file order"


def gap_text(status: str) -> str:
    return status[len("gap:") :].strip()


def build(text: str) -> str:
    """The new block (markers included) for the tables in ``text``."""
    rows = parse(text)
    old_block = text.partition(START)[2].partition(END)[0]
    old_values = old_block.partition(VALUES_HEADING)[2].partition(OTHER_HEADING)[0]
    old_order = {key: i for i, key in enumerate(QUEUE_ITEM.findall(old_values))}

    gaps = [r for r in rows if status_of(r) == "gap"]
    values = [r for r in gaps if gap_text(r.status).startswith(VALUES_TAG)]
    others = [r for r in gaps if not gap_text(r.status).startswith(VALUES_TAG)]
    values.sort(key=lambda r: old_order.get((r.file, r.test), len(old_order)))  # stable: table order after

    def line(row) -> str:
        body = gap_text(row.status)
        if body.startswith(VALUES_TAG):
            body = body[len(VALUES_TAG) :].strip()
        return f"- `{row.file}` `{row.test}`: {body}"

    files = {r.file for r in rows}
    counts = {s: sum(status_of(r) == s for r in rows) for s in STATUSES}
    parts = [
        START,
        "## Counts and work queue",
        "",
        f"Counted: {len(files)} files, {len(rows)} tests.",
        f"By status: {counts['ours']} ours, {counts['n/a']} n/a, {counts['diff']} diff, {counts['gap']} gap.",
        "",
        VALUES_HEADING,
        "",
        *map(line, values),
        "",
        OTHER_HEADING,
        "",
        *map(line, others),
        END,
    ]
    return "\n".join(parts)


def rewrite(text: str) -> str:
    head, sep, rest = text.partition(START)
    if not sep or END not in rest:
        raise SystemExit(f"{INVENTORY} lacks the {START} / {END} markers")
    tail = rest.partition(END)[2]
    return head + build(text) + tail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether the block is current")
    args = parser.parse_args()
    text = INVENTORY.read_text()
    new = rewrite(text)
    if args.check:
        if new == text:
            return 0
        sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True), "old", "new"))
        return 1
    INVENTORY.write_text(new)
    rows = parse(new)
    print(
        f"{INVENTORY.relative_to(ROOT)}: {len({r.file for r in rows})} files, {len(rows)} tests, "
        f"{sum(status_of(r) == 'gap' for r in rows)} gaps"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
