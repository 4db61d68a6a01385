"""The key figure of one ``gpu_acceptance.sh`` step, read from its log: one short line for the summary.

    python benchmarks/acceptance_figures.py STEP RC OUT     # reads OUT/STEP.log (and OUT/*.jsonl for train)

Speed checks print their ratios next to issue 33's targets with ``ok`` or
``MISS``; under ``DRY=1`` (CPU, tiny models, fake group) the ratios only prove
the parsing and are marked ``dry``. A step that failed shows its last log line
instead (the exception, usually). Standard library only: it runs after every
step, also where torch is broken.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys

# (figure in the log, target, what it is compared with): issue 33, item 3
TARGETS = {
    "bench-offload": {"step": 1.1, "peak": 1.0},  # fullshard / FSDP2, both with CPUOffloadPolicy
    "bench-world1": {"step": 1.03},  # fullshard / the plain model
    "bench-fake8": {"step": 0.9, "peak": 0.85},  # fullshard / FSDP2
    "bench-fake64": {},  # recorded, no target
}
RATIO = re.compile(r"fullshard / (\w+): step time ([\d.na]+)x, peak ([\d.na]+)x")
QUANTIZED = re.compile(r"fullshard-(\w+) / fullshard: step time ([\d.na]+)x")


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:110] if lines else "(empty log)"


def judged(value: float, target: float | None) -> str:
    if target is None:
        return ""
    if os.environ.get("DRY") == "1":
        return f" (<= {target}, dry)"
    if math.isnan(value):
        return f" (<= {target}, not measured)"
    return f" (<= {target} {'ok' if value <= target else 'MISS'})"


def judged_equal(difference: float, tolerance: float = 1e-4) -> str:
    if os.environ.get("DRY") == "1":
        return " (dry)"
    return f" ({'ok' if abs(difference) <= tolerance else 'MISS'}, |d| <= {tolerance})"


def bench_figure(step: str, log: str) -> str | None:
    matches = RATIO.findall(log)
    if not matches:
        return None
    other, step_ratio, peak_ratio = matches[0]
    targets = TARGETS.get(step, {})
    parts = [f"step {float(step_ratio):.3f}x {other}{judged(float(step_ratio), targets.get('step'))}"]
    if other != "local":
        parts.append(f"peak {float(peak_ratio):.3f}x{judged(float(peak_ratio), targets.get('peak'))}")
    parts += [f"{dtype} step {float(ratio):.3f}x fullshard" for dtype, ratio in QUANTIZED.findall(log)]
    return ", ".join(parts)


def final_loss(out: str, step: str) -> float | None:
    try:
        with open(os.path.join(out, f"{step}.jsonl")) as f:
            lines = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return None
    summaries = [line["summary"] for line in lines if "summary" in line]
    return summaries[-1]["final_loss"] if summaries else None


def train_figure(step: str, log: str, out: str) -> str | None:
    """Rank 0's peak next to the plan's, the final loss; offload's loss against the same run without."""
    memory = re.search(r"^rank 0\s+(\S+ \S+)\s+(\S+ \S+)\s+(\S+ \S+)", log, re.MULTILINE)
    loss = final_loss(out, step)
    if memory is None or loss is None:
        return None
    where = "GPU" if "max_memory_allocated" in log else "CPU"
    figure = f"loss {loss:.4f}, {where} peak {memory.group(2)} (plan {memory.group(3)})"
    if step.endswith("-offload"):
        without = final_loss(out, step[: -len("-offload")])
        if without is not None:
            figure += f", loss - no offload {loss - without:+.1e}"
            if step == "train-fp32-offload":  # issue 33: offload equals no offload in fp32
                figure += judged_equal(loss - without)
    return figure


def figure(step: str, rc: str, out: str) -> str:
    try:
        with open(os.path.join(out, f"{step}.log"), errors="replace") as f:
            log = f.read()
    except OSError:
        return "(no log)"
    found = None
    if step == "env":
        found = last_line(log)
    elif step.startswith("tests") or step == "suite":
        counts = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|errors?|deselected).*?)(?: in [\d.]+s.*)?=*$",
                            log, re.MULTILINE)
        found = counts[-1].strip(" =") if counts else None
    elif step.startswith("train"):
        found = train_figure(step, log, out)
    elif step == "compile":
        found = next((line.split(":", 1)[1].strip() for line in log.splitlines()
                      if line.startswith("compile parity:")), None)
    elif step.startswith("bench"):
        found = bench_figure(step, log)
    if rc in ("124", "137"):  # what it printed before the cap may still hold the figure
        return "TIMED OUT: " + (found or last_line(log))
    if found is None or (rc != "0" and not step.startswith("tests")):
        return (found + "; " if found else "") + last_line(log)
    return found


if __name__ == "__main__":
    print(figure(*sys.argv[1:4]))
