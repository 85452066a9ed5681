"""Each mode's CPU a worker per step, split into the training thread's and the other threads', priced
(by the plan's costs on its profile: the step's CPU and on-thread compression on the training thread,
the rest of each cost's CPU in training on the others) and measured (training_thread_cpu_s and the
process's cpu_mean_s, ranks' means over the timed steps), in ms and in each one's speed references.
From the project root: PYTHONPATH=src .venv/bin/python docs/results/thread-cpu/split.py RUN.json..."""
import json
import os
import statistics
import sys

from sparcoll.plan.command import priced_as_stored

modes = "docs/results/plan-b08b413-modes"
profile = json.load(open(os.path.join(modes, "deeplight-profile.json")))
profile_ref = profile["model"]["reference_cpu_s"]
for path in sys.argv[1:]:
    for run in json.load(open(path))["runs"]:
        label = run["label"]
        name = "deeplight-plan.json" if label == "planned" else os.path.basename(label.split("=", 1)[-1])
        plan = json.load(open(os.path.join(modes, name)))
        step, tensors, chosen = priced_as_stored(profile, plan)
        costs = [t.costs[o] for t, o in zip(tensors, chosen)]
        main = step.cpu + sum(c.compress_cpu for c in costs if not c.offload)
        others = sum(c.in_training for c in costs) - sum(c.compress_cpu for c in costs if not c.offload)
        thread, process = run["training_thread_cpu_s"], run["cpu_mean_s"]
        ref = statistics.median(run["per_step"]["reference_cpu_s"][2:])
        print(f"{os.path.basename(path)} {name[10:-5]:<18} training thread priced {1e3 * main:5.1f} ms "
              f"({main / profile_ref:5.2f} refs), measured {1e3 * thread:5.1f} ({thread / ref:5.2f}); other threads "
              f"priced {1e3 * others:5.1f} ({others / profile_ref:5.2f}), measured {1e3 * (process - thread):5.1f} "
              f"({(process - thread) / ref:5.2f}); step {1e3 * run['step_s']:.1f} ms, "
              f"predicted {1e3 * plan['predicted_step_s']:.1f}")
