"""Each workload's kept plan: predicted step, each separate job's measured step and the ratio, the same with
the prediction's CPU scaled to the job's machine speed (where the prediction is the CPU bound plus the idle
wait), and CPU per worker per step in speed references, predicted and measured.
From the project root: .venv/bin/python docs/results/plan-0de37c5-fresh/summary.py [DIR] (DIR: this one's)"""
import json
import os
import statistics
import sys

here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
for w in ("ncf", "gpt", "deeplight", "vgg"):
    try:
        plan = json.load(open(os.path.join(here, f"{w}-plan.json")))
    except FileNotFoundError:
        continue
    pred, ref = plan["predicted_step_s"], plan["reference_cpu_s"]
    cpu, idle = plan["cpu_bound_s"], plan["idle_s"]
    cpu_bound = cpu + idle >= pred * (1 - 1e-9)
    print(f"{w}: predicted {1e3 * pred:.1f} ms ({'CPU bound' if cpu_bound else 'timeline'}; CPU {1e3 * cpu:.1f} + idle "
          f"{1e3 * idle:.1f}), CPU a worker {1e3 * cpu / 2 / (1e3 * ref):.2f} references; trial kept {plan['trial']['kept']}")
    for i in (1, 2, 3):
        try:
            run = json.load(open(os.path.join(here, f"{w}-planned-{i}.json")))["runs"][0]
        except FileNotFoundError:
            continue
        speed = statistics.median(run["per_step"]["reference_cpu_s"][2:])
        scaled = cpu * speed / ref + idle if cpu_bound else pred
        print(f"  run {i}: {1e3 * run['step_s']:.1f} ms, predicted / measured {pred / run['step_s']:.2f}, "
              f"at the run's speed {scaled / run['step_s']:.2f}; CPU a worker {run['cpu_mean_s'] / speed:.2f} references, "
              f"idle {1e3 * (run['step_s'] - 2 * run['cpu_mean_s']):.1f} ms")
