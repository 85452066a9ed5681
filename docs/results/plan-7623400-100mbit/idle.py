"""Per mode of this directory's rounds: the cores' idle time per step as measured (step - 2 x the ranks'
mean CPU, 4 workers on 2 cores) and as priced (timeline._idle), the simulated wait after backward
(`tail`), and the CPU a worker per step, measured and priced (ms at the profile's machine speed: the
measured scaled by the profile's speed reference over the run's). idle.txt holds the idle time as `7623400` priced it
(the wait less one worker's CPU in it); since `e7fd6da` the script prices it by the cores' arithmetic (its
output then: idle-e7fd6da.txt).
From the project root: PYTHONPATH=src:benchmarks .venv/bin/python docs/results/plan-7623400-100mbit/idle.py"""
import json
from pathlib import Path

from plan_summary import runs_by_plan
from sparcoll.plan.command import priced_as_stored
from sparcoll.plan.timeline import simulate

here = Path(__file__).parent
profile = json.loads((here / "deeplight-profile.json").read_text())
ref = profile["model"]["reference_cpu_s"]
for name, measured in runs_by_plan(here, "deeplight").items():
    step, tensors, chosen = priced_as_stored(profile, json.loads((here / name).read_text()))
    costs = [t.costs[o] for t, o in zip(tensors, chosen)]
    timeline = simulate(step, costs)
    tail = max(timeline.comm_end + [timeline.backward_end]) - timeline.backward_end
    idle = [1e3 * (r["step_s"] - 2 * r["cpu_mean_s"]) for r in measured]
    cpu = [1e3 * r["cpu_mean_s"] * ref / r["reference_cpu_s"] for r in measured]
    priced_cpu = 1e3 * (step.cpu + sum(c.cpu for c in costs))
    print(f"{name[10:-5]:<28} idle measured {min(idle):6.1f}-{max(idle):6.1f} priced {1e3 * timeline.idle:6.1f} "
          f"tail {1e3 * tail:6.1f} | CPU a worker measured {min(cpu):6.1f}-{max(cpu):6.1f} priced {priced_cpu:6.1f}")
