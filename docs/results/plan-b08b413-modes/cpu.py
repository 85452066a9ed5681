"""Each mode's CPU a worker per step and the cores' idle time, priced by its plan and measured in the
rounds (in ms and in units of the speed reference: the profile's, and each run's median), with the
step predicted and measured. From the project root:
.venv/bin/python docs/results/plan-b08b413-modes/cpu.py > docs/results/plan-b08b413-modes/cpu.txt"""
import json
import os
import statistics

here = os.path.dirname(os.path.abspath(__file__))
profile_ref = json.load(open(os.path.join(here, "deeplight-profile.json")))["model"]["reference_cpu_s"]
lines = []
for i in (1, 2, 3):
    for run in json.load(open(os.path.join(here, f"deeplight-r{i}.json")))["runs"]:
        label = run["label"]
        name = "deeplight-plan.json" if label == "planned" else os.path.basename(label) if ":" in label else None
        if name is None:
            continue
        plan = json.load(open(os.path.join(here, name)))
        cores = plan["cores_per_worker"]
        priced = plan["cpu_bound_s"] * cores
        ref = statistics.median(run["per_step"]["reference_cpu_s"][2:])
        measured = run["cpu_mean_s"]
        lines.append(f"{name[10:-5]:<24} round {i}: CPU a worker priced {1e3 * priced:.1f} ms "
                     f"({priced / profile_ref:.2f} references), measured {1e3 * measured:.1f} ({measured / ref:.2f}): "
                     f"{(priced / profile_ref) / (measured / ref):.2f} in references; idle priced "
                     f"{1e3 * plan['idle_s']:.1f} ms, measured {1e3 * (run['step_s'] - measured / cores):.1f}; "
                     f"step predicted {1e3 * plan['predicted_step_s']:.1f}, measured {1e3 * run['step_s']:.1f}")
print("\n".join(sorted(lines)))
