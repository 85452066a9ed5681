"""Markdown tables from benchmarks/run_compress.sh's JSON: per workload, each mode's step time, bytes
per step, speedup over DDP and final loss against DDP's, as ranges over the rounds that ran it, and
DDP's communication share of the step.

    python3 benchmarks/compress_summary.py OUT_DIR
"""
import collections
import json
import pathlib
import re
import sys


def span(values, fmt):
    low, high = (fmt.format(v).replace("-0.0", "+0.0") for v in (min(values), max(values)))
    if low == high:
        return low
    return f"{low} to {high}" if "-" in low + high else f"{low}-{high}"     # a range, not a minus


def main(out_dir: str) -> None:
    by_workload = collections.defaultdict(list)
    for path in sorted(pathlib.Path(out_dir).glob("*-r*.json")):
        workload = re.sub(r"-r\d+$", "", path.stem)
        by_workload[workload].append(json.loads(path.read_text()))
    for workload, reports in by_workload.items():
        rows = collections.defaultdict(lambda: collections.defaultdict(list))
        order = []
        for report in reports:
            speedups = {m["label"]: m for m in report["compare"]["modes"]}
            for run in report["runs"]:
                row = rows[run["label"]]
                if run["label"] not in order:
                    order.append(run["label"])
                row["step"].append(1e3 * run["step_s"])
                row["comm"].append(1e3 * run["comm_s"])
                row["share"].append(run["comm_s"] / run["step_s"])
                row["mb"].append((run["bytes_sent_per_step"] or 0) / 1e6)
                row["final"].append(run["final_loss"])
                versus = speedups.get(run["label"])
                row["speedup"].append(versus["speedup"] if versus else 1.0)
                row["dloss"].append(100 * versus["final_loss_difference"] if versus else 0.0)
        first = reports[0]
        print(f"### {workload}: {first['workers']} workers, {first['network']}, {first['steps']} steps "
              f"of {first['batch_size']} per worker, {len(reports)} rounds\n")
        print(f"final loss: {first['runs'][0]['final_loss_kind']}\n")
        print("| mode | rounds | step ms | comm ms (share) | MB/step/worker | x DDP | final loss | vs DDP |")
        print("|---|---|---|---|---|---|---|---|")
        for label in order:
            r = rows[label]
            print(f"| {label} | {len(r['step'])} | {span(r['step'], '{:.0f}')} | "
                  f"{span(r['comm'], '{:.0f}')} ({span([100 * s for s in r['share']], '{:.0f}')}%) | "
                  f"{span(r['mb'], '{:.2f}')} | {span(r['speedup'], '{:.2f}')} | "
                  f"{span(r['final'], '{:.3f}')} | {span(r['dloss'], '{:+.1f}')}% |")
        print()


if __name__ == "__main__":
    main(sys.argv[1])
