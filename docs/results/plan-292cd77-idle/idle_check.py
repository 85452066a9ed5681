"""Per mode of a run_plan.sh directory: how long the cores stood idle per step as measured (step - 2 x the
ranks' mean CPU, 4 workers on 2 cores), the simulated wait after backward (`tail`) and the idle time the
simulator prices (`L-w`, timeline._idle), and the CPU per worker and step in units of the machine's speed
reference, measured and predicted (the profile's). Usage: idle_check.py ROUNDS_DIR PROFILE_DIR"""
import dataclasses, json, sys, glob, statistics
from pathlib import Path
from sparcoll.plan.command import priced
from sparcoll.plan.fusion import as_planned
from sparcoll.plan.timeline import simulate
d, prof = Path(sys.argv[1]), Path(sys.argv[2])
for w in ("ncf", "gpt", "deeplight"):
    profile = json.load(open(prof / f"{w}-profile.json"))
    step, measured, groups, tensors, costing = priced(profile, list(profile["compressors"]))
    runs = {}
    for f in sorted(d.glob(f"{w}-r*.json")):
        for run in json.load(open(f))["runs"]:
            if run["comm"] != "ddp":
                name = "planned" if run["comm"] == "planned" else Path(run["strategy"]).name
                runs.setdefault(name, []).append(run)
    for name, rs in runs.items():
        plan = json.load(open(d / (f"{w}-plan.json" if name == "planned" else name)))
        by_name = {t["name"]: t for t in plan["tensors"]}
        chosen = [next(o for o in t.costs if str(o) == by_name[measured[g[-1]].facts.name]["option"]) for g, t in zip(groups, tensors)]
        ustep, ut, uc = as_planned(step, measured, groups, tensors, chosen, costing, {n: t["unit"] for n, t in by_name.items()})
        costs = [t.costs[o] for t, o in zip(ut, uc)]
        tl = simulate(ustep, costs)
        waited = max(tl.comm_end + [tl.backward_end])
        L = waited - tl.backward_end
        idle_m = [1e3 * (r["step_s"] - 2 * r["cpu_mean_s"]) for r in rs]
        cpu_m = [1e3 * r["cpu_mean_s"] / (1e3 * r["reference_cpu_s"]) for r in rs]
        cpu_p = 1e3 * (ustep.cpu + sum(c.cpu for c in costs)) / (1e3 * profile["model"]["reference_cpu_s"])
        print(f"{w:<9} {name[:32]:<32} idle measured {min(idle_m):5.1f}-{max(idle_m):5.1f}  tail {1e3*L:5.1f} L-w {1e3*tl.idle:5.1f} "
              f"| CPU/ref measured {min(cpu_m):5.2f}-{max(cpu_m):5.2f} predicted {cpu_p:5.2f}")
