"""Per mode of this directory's rounds (the slowest rank's steps, as `sparcoll train` reported them at
5ab06fd): the wait after backward as priced (`tail`) and as the last step's trace shows it, the workers'
CPU in that wait (`work`, a worker's), the time the cores stand idle as 5ab06fd priced it (the wait
less one worker's CPU in it) and as the next commit does (less that over the cores a worker has: half a
core here), and as measured (step - 2 x the ranks' mean CPU); and a worker's CPU per step, priced and
measured. Of another run_plan.sh directory (../plan-e7fd6da: its steps the ranks' mean) with DIR.
From the project root: PYTHONPATH=src:benchmarks .venv/bin/python docs/results/plan-5ab06fd-modes/idle.py [DIR]"""
import json
import sys
from pathlib import Path

from plan_summary import runs_by_plan
from sparcoll.plan.command import priced_as_stored
from sparcoll.plan.timeline import simulate

here = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
for w in ("ncf", "gpt", "deeplight"):
    profile = json.loads((here / f"{w}-profile.json").read_text())
    for name, measured in runs_by_plan(here, w).items():
        step, tensors, chosen = priced_as_stored(profile, json.loads((here / name).read_text()))
        costs = [t.costs[o] for t, o in zip(tensors, chosen)]
        timeline = simulate(step, costs)
        tail = max(timeline.comm_end + [timeline.backward_end]) - timeline.backward_end
        work = (tail - timeline.idle) * min(1.0, step.cores)
        idle = [1e3 * (r["step_s"] - 2 * r["cpu_mean_s"]) for r in measured]
        cpu = [1e3 * r["cpu_mean_s"] for r in measured]
        priced_cpu = sum(c.in_training for c in costs)
        traced = [1e3 * (max(t[4] for t in r["trace"]["tensors"]) - r["trace"]["backward_end"]) for r in measured]
        print(f"{name[:-5]:34} tail {1e3 * tail:6.1f} (traced {min(traced):6.1f}-{max(traced):6.1f}) work "
              f"{1e3 * work:5.1f} | idle priced {1e3 * (tail - work):6.1f} -> {1e3 * timeline.idle:6.1f}, "
              f"measured {min(idle):6.1f}-{max(idle):6.1f} | CPU {1e3 * (step.cpu + priced_cpu):6.1f}, "
              f"measured {min(cpu):6.1f}-{max(cpu):6.1f}")
