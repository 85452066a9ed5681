"""A plan's predicted CPU per step of a worker (the step's and every unit's) under each given profile. Run here
with PYTHONPATH=<project>/src: python plancpu.py ../plan-bb1d344-cpu/ncf-plan.json p-*.json more/p-h-*.json"""
import json, sys
from sparcoll.plan.command import priced
from sparcoll.plan.fusion import as_planned

plan = json.load(open(sys.argv[1]))
by_name = {t["name"]: t for t in plan["tensors"]}
units = {n: t["unit"] for n, t in by_name.items()}
for f in sys.argv[2:]:
    profile = json.load(open(f))
    step, measured, groups, tensors, costing = priced(profile, list(profile["compressors"]))
    chosen = [next(o for o in t.costs if str(o) == by_name[measured[g[-1]].facts.name]["option"]) for g, t in zip(groups, tensors)]
    ustep, utensors, uchosen = as_planned(step, measured, groups, tensors, chosen, costing, units)
    costs = [t.costs[o] for t, o in zip(utensors, uchosen)]
    print(f"{f.split('/')[-1]:14} v{profile['version']} step cpu {ustep.cpu*1e3:5.2f} units {sum(c.cpu for c in costs)*1e3:5.2f} total {1e3*(ustep.cpu+sum(c.cpu for c in costs)):5.2f} ms")
