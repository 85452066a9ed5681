"""Stored plans priced again by their own profiles under the code on PYTHONPATH: per plan its predicted
step (ms), the cores' idle time in it, and each run's measured step and idle time (the step less the
ranks' mean CPU over the cores a worker has). From the project root:
PYTHONPATH=<work tree>/src .venv/bin/python docs/results/idle-in-training/evaluate.py"""
import glob
import json
import os
import statistics

from sparcoll.plan.command import priced_as_stored
from sparcoll.plan.timeline import simulate

# (profile, plan, runs) of every fresh check with runs of the plan it kept
SETS = []
profiles = glob.glob("docs/results/*/*-profile.json") + glob.glob("docs/results/timeline-windows/ab/*-profile.json")
for profile in sorted(profiles):
    stem = profile[:-len("-profile.json")]
    runs = sorted(glob.glob(stem + "-planned*.json"))
    # the checks since e7fd6da, whose runs' step is the ranks' mean (before it, the slowest rank's)
    checked = any(d in stem for d in ("e7fd6da-", "9a6187c-fresh", "batches-fresh", "timeline-windows"))
    if os.path.exists(stem + "-plan.json") and runs and checked:
        SETS.append((profile, stem + "-plan.json", runs))
ratios, idle_errors = [], []
for profile_path, plan_path, run_paths in SETS:
    profile, plan = json.load(open(profile_path)), json.load(open(plan_path))
    step, tensors, chosen = priced_as_stored(profile, plan)
    timeline = simulate(step, [t.costs[o] for t, o in zip(tensors, chosen)])
    predicted = plan["forward_s"] + timeline.iteration
    cores = profile["model"]["cores_per_worker"]
    line = f"{plan_path[13:]}: predicted {1e3 * predicted:.1f} (idle {1e3 * timeline.idle:.1f}); measured"
    for path in run_paths:
        run = json.load(open(path))["runs"][0]
        idle = run["step_s"] - run["cpu_mean_s"] / cores
        ratios.append(predicted / run["step_s"])
        idle_errors.append(timeline.idle - idle)
        line += f" {1e3 * run['step_s']:.1f} (idle {1e3 * idle:.1f}, {predicted / run['step_s']:.2f})"
    print(line)
print(f"{len(ratios)} runs: predicted / measured {min(ratios):.2f}-{max(ratios):.2f}, "
      f"{sum(abs(r - 1) <= 0.1 for r in ratios)} within 10%; idle predicted less measured: median "
      f"{1e3 * statistics.median(idle_errors):.1f} ms, {1e3 * min(idle_errors):.1f} to {1e3 * max(idle_errors):.1f}")
