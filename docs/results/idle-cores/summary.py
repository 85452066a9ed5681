"""Per run: the step, the busiest rank's and the ranks' mean CPU, and the cores' idle time a step
(cores x step - workers x mean CPU), with the strategy's prediction (its plan file) beside it.
From the project root: .venv/bin/python docs/results/idle-cores/summary.py"""
import glob
import json
import os
import re

here = os.path.dirname(os.path.abspath(__file__))
plans = os.path.join(here, "..", "plan-63e569f-speed")
CORES, WORKERS = 2, 4
print(f"{'run':<26} {'step':>6} {'CPU max':>7} {'CPU mean':>8} {'idle':>6} {'ref':>5} "
      f"{'predicted':>9} {'CPU bound':>9}")
for path in sorted(glob.glob(os.path.join(here, "*-[0-9].json"))):
    name = os.path.basename(path)[:-5]
    workload, strategy = re.match(r"(\w+)-(.*)-\d$", name).groups()
    plan_file = {"plan": "plan", "u-blocktopk": "u-blocktopk_0.01"}.get(strategy, strategy)
    plan = json.load(open(os.path.join(plans, f"{workload}-{plan_file}.json")))
    run = json.load(open(path))["runs"][0]
    step, cpu, mean, ref = (1e3 * run[k] for k in ("step_s", "cpu_s", "cpu_mean_s", "reference_cpu_s"))
    idle = CORES * step - WORKERS * mean
    bound = plan.get("cpu_bound_s")
    print(f"{name:<26} {step:6.1f} {cpu:7.1f} {mean:8.1f} {idle / CORES:6.1f} {ref:5.2f} "
          f"{1e3 * plan['predicted_step_s']:9.1f} {1e3 * bound if bound else float('nan'):9.1f}")
