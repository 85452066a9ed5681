"""Per profile of a directory (W-profile-N.json, W-plan-N.json): the kept plan's prediction, a
worker's CPU (the CPU bound over the cores a worker has), the training step's CPU (given at the
profile's speed, and as measured), the profile's reference and the CPU in units of it:
    .venv/bin/python docs/results/profile-speed-median/summary.py DIR [WORKLOAD]"""
import json
import sys
from pathlib import Path

out, w = Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "ncf"
print("| profile | kept plan predicted ms | CPU per worker ms | the step's (as measured) | reference ms "
      "| CPU / reference | step's CPU / reference |")
print("|---|---|---|---|---|---|---|")
for i in range(1, 10):
    plan_file, profile_file = out / f"{w}-plan-{i}.json", out / f"{w}-profile-{i}.json"
    if not plan_file.exists():
        break
    plan, model = json.loads(plan_file.read_text()), json.loads(profile_file.read_text())["model"]
    cpu = plan["cpu_bound_s"] * plan["cores_per_worker"]
    ref = model["reference_cpu_s"]
    print(f"| {i} | {plan['predicted_step_s'] * 1e3:.1f} | {cpu * 1e3:.2f} | {model['cpu'] * 1e3:.2f} "
          f"({model.get('measured_cpu', model['cpu']) * 1e3:.2f}) | {ref * 1e3:.3f} | {cpu / ref:.2f} "
          f"| {model['cpu'] / ref:.2f} |")
