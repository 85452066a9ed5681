"""Section 4's training table from benchmarks/run_train.sh's rounds: per workload, the range over the
rounds of each mode's step (compute + the communication that did not overlap it), DDP's share of its
step spent communicating, sparcoll's speedup over DDP in the same round, and the largest difference
between the two loss curves.

    python3 benchmarks/train_summary.py OUT
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from summaries import loss_difference, span

WORKLOADS = ("deeplight", "ncf", "lstm", "cnn")


def main(argv: list[str]) -> int:
    root = Path(argv[0])
    rounds = sorted(p for p in root.glob("r[0-9]*") if p.is_dir())
    print(f"{len(rounds)} rounds")
    print("| workload | block density local / union | sparcoll step ms (compute + comm) | "
          "ddp step ms (compute + comm) | DDP communicating | speedup | largest loss difference |")
    print("|---|---|---|---|---|---|---|")
    for workload in WORKLOADS:
        runs = [json.loads(f.read_text())["runs"] for r in rounds if (f := r / f"train-{workload}.json").exists()]
        if not runs:
            continue
        ours = [next(x for x in r if x["comm"] == "sparcoll") for r in runs]
        ddp = [next(x for x in r if x["comm"] == "ddp") for r in runs]

        def ms(mode: list[dict], key: str) -> str:
            return span([1e3 * x[key] for x in mode])

        def step(mode: list[dict]) -> str:
            return f"{ms(mode, 'step_s')} ({ms(mode, 'compute_s')} + {ms(mode, 'comm_s')})"
        speedup = span([d["step_s"] / s["step_s"] for s, d in zip(ours, ddp)], "{:.2f}")
        share = span([100 * d["comm_s"] / d["step_s"] for d in ddp], "{:.0f}")
        loss = max(loss_difference(s["loss"], d["loss"]) for s, d in zip(ours, ddp))
        density = f"{ours[0]['density_local']:.1%} / {ours[0]['density_union']:.1%}"
        print(f"| {workload} | {density} | {step(ours)} | {step(ddp)} | {share}% | **{speedup}x** | {loss:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
