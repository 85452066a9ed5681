"""A plan's predicted CPU per step and worker, split: the step's, compression (training thread), decompression, collectives."""
import json, sys
from sparcoll.plan.command import priced
from sparcoll.plan.fusion import as_planned
from sparcoll.plan.costs import _own_or_curve

plan = json.load(open(sys.argv[1]))
by_name = {t["name"]: t for t in plan["tensors"]}
units = {n: t["unit"] for n, t in by_name.items()}
for f in sys.argv[2:]:
    profile = json.load(open(f))
    step, measured, groups, tensors, costing = priced(profile, list(profile["compressors"]))
    chosen = [next(o for o in t.costs if str(o) == by_name[measured[g[-1]].facts.name]["option"]) for g, t in zip(groups, tensors)]
    ustep, utensors, uchosen = as_planned(step, measured, groups, tensors, chosen, costing, units)
    total = sum(t.costs[o].cpu for t, o in zip(utensors, uchosen))
    comp = dec = 0.0
    big = {}
    for g, o in zip(groups, chosen):
        for i in g:
            m = measured[i]
            c = o.compressor
            if c == "none" or m.facts.coo: continue
            a = _own_or_curve(costing.compress_cpu_own, costing.compress_cpu, c, m, missing=0.0)
            b = _own_or_curve(costing.decompress_cpu_own, costing.decompress_cpu, c, m, missing=0.0)
            comp += a; dec += b
            if m.facts.numel > 65536: big[m.facts.name] = (round(a*1e3, 2), round(b*1e3, 2))
    print(f"{f.split('/')[-1]:14} step {ustep.cpu*1e3:5.2f} compress {comp*1e3:5.2f} decompress {dec*1e3:5.2f} "
          f"collectives {1e3*(total-comp-dec):5.2f} total {1e3*(ustep.cpu+total):5.2f} ms; large {big}")
