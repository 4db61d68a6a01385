"""Loss curves of several ``fullshard train --metrics`` runs, side by side.

    fullshard train --nproc 2 --steps 1000 --mixed-precision bf16 --metrics bf16.jsonl
    fullshard train --nproc 2 --steps 1000 --mixed-precision bf16 --all-gather-dtype int8 --metrics int8.jsonl
    python benchmarks/plot_losses.py bf16.jsonl int8.jsonl --out losses.png

Left: the training loss of every run (a moving average over ``--window`` steps);
right: each run's relative difference to the first one's, smoothed the same way.
Needs matplotlib (``pip install 'fullshard[plot]'``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read(path: str) -> tuple[list[float], dict]:
    """A run's per-step losses and its summary line."""
    losses, summary = [], {}
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        if "summary" in record:
            summary = record["summary"]
        else:
            losses.append(record["loss"])
    return losses, summary


def smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for index, value in enumerate(values):
        total += value - (values[index - window] if index >= window else 0.0)
        out.append(total / min(index + 1, window))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", help="--metrics files; the first is the reference")
    parser.add_argument("--labels", help="comma-separated, one per file (default: the file names)")
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--out", default="losses.png")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = args.labels.split(",") if args.labels else [Path(p).stem for p in args.metrics]
    runs = [read(path) for path in args.metrics]
    reference = smooth(runs[0][0], args.window)
    figure, (curves, differences) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, (losses, summary) in zip(labels, runs):
        smoothed = smooth(losses, args.window)
        final, validation = summary.get("final_loss"), summary.get("validation_loss")
        curves.plot(smoothed, label=f"{label} (final {final:.4f}, validation {validation:.4f})")
        differences.plot([100 * (a - b) / b for a, b in zip(smoothed, reference)], label=label)
        print(f"{label:<12} final {final:.4f}  validation {validation:.4f}  "
              f"all-gather bytes/step {summary.get('comm_bytes_per_step', {}).get('all_gather', 0):,}")
    curves.set(xlabel="step", ylabel=f"training loss (mean of {args.window})", title="loss")
    differences.set(xlabel="step", ylabel=f"% vs {labels[0]}", title="relative difference")
    curves.legend()
    differences.legend()
    figure.tight_layout()
    figure.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
