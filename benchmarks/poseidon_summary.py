"""Markdown tables and a plot from benchmarks/run_poseidon.sh's JSON.

vgg-r*.json (4 workers, 1 Gbit/s): each mode's step time, bytes per step next to the cost model's
prediction, speedup over DDP, loss curve against DDP's and the communication hidden behind backward,
as ranges over the rounds. sweep-*.json: DDP and Poseidon's hybrid over workers and link rates, with
the speedup over DDP and over one worker (P t1 / tP: throughput against a single worker's), plotted.

    .venv/bin/python benchmarks/poseidon_summary.py OUT_DIR      (matplotlib for the plot)
"""
import collections
import json
import pathlib
import sys

from compress_summary import span

from sparcoll.bench.netem import parse_rate


def main_table(reports: list) -> None:
    rows = collections.defaultdict(lambda: collections.defaultdict(list))
    for report in reports:
        versus = {m["label"]: m for m in report["compare"]["modes"]}
        for run in report["runs"]:
            row = rows[run["label"]]
            row["step"].append(1e3 * run["step_s"])
            row["comm"].append(1e3 * run["comm_s"])
            row["mb"].append((run["bytes_sent_per_step"] or 0) / 1e6)
            if run.get("predicted_bytes_per_step"):
                row["predicted"].append(run["predicted_bytes_per_step"] / 1e6)
            if run.get("comm_total_s"):
                row["hidden"].append(100 * run["comm_hidden_s"] / run["comm_total_s"])
            mode = versus.get(run["label"])
            row["speedup"].append(mode["speedup"] if mode else 1.0)
            row["dloss"].append(mode["max_loss_difference"] if mode else 0.0)
    first = reports[0]
    print(f"### vgg: {first['workers']} workers, {first['network']}, {first['steps']} steps of "
          f"{first['batch_size']} per worker, {len(reports)} rounds\n")
    print("| mode | rounds | step ms | non-overlapped comm ms | MB/step/worker | predicted MB | x DDP | "
          "largest loss difference | comm hidden behind backward |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, r in rows.items():
        predicted = span(r["predicted"], "{:.2f}") if r["predicted"] else ""
        hidden = span(r["hidden"], "{:.0f}") + "%" if r["hidden"] else ""
        print(f"| {label} | {len(r['step'])} | {span(r['step'], '{:.0f}')} | {span(r['comm'], '{:.0f}')} | "
              f"{span(r['mb'], '{:.2f}')} | {predicted} | {span(r['speedup'], '{:.2f}')} | "
              f"{span(r['dloss'], '{:.1e}')} | {hidden} |")
    print()


def sweep(out: pathlib.Path) -> None:
    single = json.loads((out / "single.json").read_text())["runs"][0]["step_s"]
    points = collections.defaultdict(dict)        # network -> workers -> {label: step_s}
    for path in sorted(out.glob("sweep-*.json")):
        report = json.loads(path.read_text())
        points[report["network"]][report["workers"]] = {r["label"]: r["step_s"] for r in report["runs"]}
    points = dict(sorted(points.items(), key=lambda item: parse_rate(item[0])))
    print(f"### sweep: vgg, batch 32 per worker; one worker alone: {1e3 * single:.0f} ms per step\n")
    print("| network | workers | DDP ms | hybrid ms | hybrid x DDP | DDP x one worker | hybrid x one worker |")
    print("|---|---|---|---|---|---|---|")
    for network, by_workers in points.items():
        for workers, steps in sorted(by_workers.items()):
            ddp, hybrid = steps["ddp"], steps["poseidon"]
            print(f"| {network} | {workers} | {1e3 * ddp:.0f} | {1e3 * hybrid:.0f} | {ddp / hybrid:.2f} | "
                  f"{workers * single / ddp:.2f} | {workers * single / hybrid:.2f} |")
    print()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for color, (network, by_workers) in zip(("C0", "C1", "C2", "C3", "C4"), points.items()):
        workers = sorted(by_workers)
        for label, style in (("poseidon", "-o"), ("ddp", "--s")):
            left.plot(workers, [w * single / by_workers[w][label] for w in workers], style, color=color,
                      label=f"{'hybrid' if label == 'poseidon' else 'DDP'}, {network}")
        right.plot(workers, [by_workers[w]["ddp"] / by_workers[w]["poseidon"] for w in workers], "-o",
                   color=color, label=network)
    left.plot([1, 8], [1, 8], ":", color="grey", label="linear")
    left.axhline(2, color="black", linewidth=0.8, linestyle="-.", label="2 cores: the most this machine does")
    left.set(xlabel="workers", ylabel="speedup over one worker (throughput)", xticks=[1, 2, 4, 8])
    right.set(xlabel="workers", ylabel="hybrid step speedup over DDP", xticks=[2, 4, 8])
    left.legend(fontsize=7)
    right.legend(fontsize=8)
    figure.suptitle("vgg head, batch 32 per worker; 8 workers share 2 cores (CPU-bound)")
    figure.tight_layout()
    figure.savefig(out / "sweep.png", dpi=100)
    print(f"plot: {out / 'sweep.png'}")


def main(out_dir: str) -> None:
    out = pathlib.Path(out_dir)
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("vgg-r*.json"))]
    if reports:
        main_table(reports)
    if (out / "single.json").exists():
        sweep(out)


if __name__ == "__main__":
    main(sys.argv[1])
