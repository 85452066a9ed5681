"""Summarize run.sh's rounds: per configuration and mode, the step (ms) and x DDP over the rounds, the
density probe on every step (old) against one step in ten, left out of the times (new); and the
last step's backward end (rank 0's trace) for the DataParallel modes.
    python3 docs/results/probe-every-tenth/summarize.py OUT"""
import json
import sys
from collections import defaultdict
from pathlib import Path


def name_of(run: dict) -> str:
    return run["comm"] if run["comm"] in ("ddp", "planned") else Path(run["strategy"]).stem


rows = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))   # config -> mode -> version -> values
for f in sorted(Path(sys.argv[1]).glob("*-r*.json")):
    config, version, _ = f.stem.rsplit("-", 2)
    runs = json.loads(f.read_text())["runs"]
    ddp = next(r["step_s"] for r in runs if r["comm"] == "ddp")
    for r in runs:
        cell = rows[config][name_of(r)][version]
        cell.append((r["step_s"] * 1e3, ddp / r["step_s"], r.get("trace", {}).get("backward_end")))


def span(values, fmt="{:.1f}"):
    values = [v for v in values if v is not None]
    return "-" if not values else f"{fmt.format(min(values))}-{fmt.format(max(values))}"


print("| configuration | mode | step ms, old | step ms, new | x DDP, old | x DDP, new | backward end ms (last step), old | new |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
for config, modes in rows.items():
    for mode, by in modes.items():
        old, new = by.get("old", []), by.get("new", [])
        cells = [span([o[0] for o in old]), span([n[0] for n in new])]
        if mode != "ddp":
            cells += [span([o[1] for o in old], "{:.2f}"), span([n[1] for n in new], "{:.2f}")]
        else:
            cells += ["1", "1"]
        cells += [span([1e3 * o[2] if o[2] else None for o in old]), span([1e3 * n[2] if n[2] else None for n in new])]
        print(f"| {config} | {mode} | " + " | ".join(cells) + f" |  ({len(old)}/{len(new)} rounds)")
