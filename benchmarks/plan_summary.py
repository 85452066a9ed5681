"""Tables of the planner's figures from benchmarks/run_plan.sh's output (docs/benchmarks.md).

    .venv/bin/python benchmarks/plan_summary.py OUT_DIR

Per workload: each mode's predicted step (`sparcoll plan`) and measured step (range over rounds), the
prediction's error (also with a CPU-bound prediction scaled to the machine's speed in that round,
bench.speed, where the profile and the round both measured it), the speedup over DDP, bytes sent and
the largest loss difference from DDP; then the plan against the best uniform strategy measured in the
same round (in a round of interleaved modes, INTERLEAVE=1, also step by step against every uniform
strategy), DDP's communication share, and what the plan's trial measured.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from summaries import loss_difference, span

from sparcoll.plan.trial import signature
from sparcoll.train.command import compare_paired, timed_steps


def name_of(label: str, workload: str) -> str:
    """A report's name for a mode: ddp, planned, uniform NAME[, whole fusion], NAME for dense gradients
    or without DIM."""
    if not label.startswith("poseidon:"):
        return label
    stem = Path(label.split(":", 1)[1]).stem.removeprefix(f"{workload}-")
    kind, _, rest = stem.partition("-")
    if kind == "dense":
        return f"{rest.replace('_', ':')} for dense gradients"
    if kind != "u":
        return f"without {rest}"
    name, whole, _ = rest.partition("-whole")
    return f"uniform {name.replace('_', ':')}" + (", whole fusion" if whole else "")


def predictions(out: Path, workload: str) -> tuple[dict[str, float], dict[str, dict]]:
    """Each mode's predicted step, and the plan file of each mode that has one."""
    plan = json.loads((out / f"{workload}-plan.json").read_text())
    pred = {"planned": plan["predicted_step_s"]}
    files = {"planned": plan}
    pred.update({f"uniform {k}": v for k, v in plan["uniform"].items()})
    for f in [*out.glob(f"{workload}-without-*.json"), *out.glob(f"{workload}-u-*.json"),
              *out.glob(f"{workload}-dense-*.json")]:
        name = name_of(f"poseidon:{f}", workload)
        files[name] = json.loads(f.read_text())
        pred[name] = files[name]["predicted_step_s"]
    return pred, files


def runs_by_plan(out: Path, workload: str) -> dict[str, list[dict]]:
    """Every round's runs of each mode but DDP, by the name of its plan file in `out` (W-plan.json for
    the plan): what a script that prices the modes again from the profile reads."""
    runs: dict[str, list[dict]] = {}
    for f in sorted(out.glob(f"{workload}-r*.json")):
        for run in json.loads(f.read_text())["runs"]:
            if run["comm"] != "ddp":
                name = f"{workload}-plan.json" if run["comm"] == "planned" else Path(run["strategy"]).name
                runs.setdefault(name, []).append(run)
    return runs


def at_run_speed(plan: dict | None, run: dict, warmup: int) -> float | None:
    """A plan's prediction with its CPU scaled by how much slower the machine ran (bench.speed's
    reference, the median over the run's timed steps) than when its profile was measured; only where
    the prediction is the workers' CPU bound (plus the time the cores stand idle, which does not
    scale), None where either speed or that is unknown."""
    if not plan or not plan.get("reference_cpu_s") or "reference_cpu_s" not in run["per_step"]:
        return None
    idle = plan.get("idle_s", 0.0)
    if not plan.get("cpu_bound_s") or plan["cpu_bound_s"] + idle < plan["predicted_step_s"] * (1 - 1e-9):
        return None
    steps = [{"probed": probed, "reference_cpu_s": speed}
             for probed, speed in zip(run["per_step"]["probed"], run["per_step"]["reference_cpu_s"])]
    speed = statistics.median(s["reference_cpu_s"] for s in timed_steps(steps, warmup))
    return plan["cpu_bound_s"] * speed / plan["reference_cpu_s"] + idle


def same_as_plan(out: Path, workload: str, label: str) -> bool:
    """Whether a round's mode runs exactly what the plan runs (then their ratio is the rounds' noise)."""
    if not label.startswith("poseidon:"):
        return False
    mode = out / Path(label.split(":", 1)[1]).name
    plan = out / f"{workload}-plan.json"
    return mode.exists() and signature(json.loads(mode.read_text())) == signature(json.loads(plan.read_text()))


def summarize(out: Path, workload: str) -> str:
    rounds = [json.loads(f.read_text()) for f in sorted(out.glob(f"{workload}-r*.json"))]
    if not rounds:
        return f"{workload}: no rounds"
    pred, files = predictions(out, workload)
    by_mode: dict[str, list[dict]] = {}
    for r in rounds:
        for run in r["runs"]:
            by_mode.setdefault(name_of(run["label"], workload), []).append(run)
    lines = [f"### {workload} ({len(rounds)} rounds, {rounds[0]['steps']} steps, batch {rounds[0]['batch_size']})",
             "", "| mode | predicted ms | measured ms | predicted / measured | at the run's machine speed "
                 "| x DDP | MB/step | max loss diff vs DDP |",
             "|---|---|---|---|---|---|---|---|"]
    ddp = [next(run for run in r["runs"] if run["comm"] == "ddp") for r in rounds]
    for mode, runs in by_mode.items():
        steps = [1e3 * run["step_s"] for run in runs]
        speed = [d["step_s"] / run["step_s"] for d, run in zip(ddp, runs)]
        sent = [run["bytes_sent_per_step"] / 1e6 for run in runs if run["bytes_sent_per_step"] is not None]
        diff = max(loss_difference(run["loss"], d["loss"]) for d, run in zip(ddp, runs))
        p = pred.get(mode)
        ratio = span([1e3 * p / s for s in steps], "{:.2f}") if p else "-"
        scaled = [at_run_speed(files.get(mode), run, rounds[0]["warmup"]) for run in runs]
        scaled = span([x / run["step_s"] for x, run in zip(scaled, runs)], "{:.2f}") \
            if scaled and None not in scaled else "-"
        lines.append(f"| {mode} | {1e3 * p:.1f} | " if p else f"| {mode} | - | ")
        lines[-1] += (f"{span(steps)} | {ratio} | {scaled} | {span(speed, '{:.2f}')} | "
                      f"{span(sent, '{:.2f}') if sent else '-'} | {diff:.2g} |")
    vs_best = []
    for r in rounds:
        uniform = [run for run in r["runs"] if name_of(run["label"], workload).startswith("uniform")]
        planned = next(run for run in r["runs"] if run["comm"] == "planned")
        best = min(uniform, key=lambda run: run["step_s"])
        vs_best.append((best["step_s"] / planned["step_s"], name_of(best["label"], workload)
                        + (", the plan's own strategy" if same_as_plan(out, workload, best["label"]) else "")))
    share = [d["comm_s"] / d["step_s"] for d in ddp]
    lines += ["", "plan vs the best uniform strategy measured in the same round: "
                  + ", ".join(f"{x:.2f}x ({name})" for x, name in vs_best)
                  + (f" (median {statistics.median(x for x, _ in vs_best):.2f}x)" if len(vs_best) > 2 else "")
              + f"; DDP's communication share of its step: {span([100 * s for s in share], '{:.0f}')}%"]
    for i, r in enumerate(rounds):
        if r.get("interleaved"):
            lines += ["", f"round {i + 1}, the modes interleaved ({r['runs'][0]['timed_steps']} "
                          f"timed steps each): the plan against each uniform strategy, the ratio of their mean "
                          f"steps and its 95% interval: " + paired(out, workload, r)]
    tried = json.loads((out / f"{workload}-plan.json").read_text()).get("trial")
    if tried:
        each = tried.get("steps_each")     # since the trial's length follows the predicted step
        length = (f"{min(each.values())}-{max(each.values())} steps" if each else f"{tried['steps']} steps")
        lines += ["", f"`sparcoll plan`'s trial ({length} each after {tried['warmup']} warm-up) kept "
                      f"**{tried['kept']}**; measured (predicted) ms: " + ", ".join(
                          f"{name} {1e3 * s:.0f} ({1e3 * tried['predicted_step_s'][name]:.0f})"
                          for name, s in sorted(tried["step_s"].items(), key=lambda kv: kv[1]))]
    return "\n".join(lines)


def paired(out: Path, workload: str, round_: dict) -> str:
    """An interleaved round's plan against each uniform strategy, step by step (paired_ratio)."""
    planned = next(run for run in round_["runs"] if run["comm"] == "planned")
    parts = []
    for run in round_["runs"]:
        name = name_of(run["label"], workload)
        if name.startswith("uniform"):
            both = compare_paired(run, planned, round_["warmup"])
            p = both["paired"]
            own = ", the plan's own strategy" if same_as_plan(out, workload, run["label"]) else ""
            parts.append(f"{name}{own} {p['ratio']:.3f}x ({p['low']:.3f}-{p['high']:.3f}; median of the steps' "
                         f"ratios {p['median']:.3f}x")
            if "paired_without_fresh_memory" in both:
                q = both["paired_without_fresh_memory"]
                parts[-1] += (f"; over the {q['steps']} steps in which neither took fresh memory "
                              f"{q['ratio']:.3f}x ({q['low']:.3f}-{q['high']:.3f})")
            parts[-1] += ")"
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0])
    workloads = sorted({f.name.split("-")[0] for f in out.glob("*-plan.json")})
    print("\n\n".join(summarize(out, w) for w in workloads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
