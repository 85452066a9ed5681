"""The CPU a profile prices for a plan, per part, per worker and step: the training step (forward,
backward, optimizer), each unit's compression (on the training thread or offloaded) and the rest of
its cost (collective and decompression). Usage: components.py PROFILE PLAN"""
import json
import sys

from sparcoll.plan.command import priced_as_stored

profile, plan = (json.load(open(f)) for f in sys.argv[1:3])
ustep, ut, uc = priced_as_stored(profile, plan)
ref = profile["model"]["reference_cpu_s"]
print(f"reference {1e3 * ref:.2f} ms; training step (forward, backward, optimizer) {1e3 * ustep.cpu:.2f} ms CPU")
on_thread = offloaded = rest = 0.0
for t, o in zip(ut, uc):
    c = t.costs[o]
    print(f"  {str(o):40s} compress {1e3 * c.compress_cpu:6.2f} ({'offloaded' if c.offload else 'on thread'})"
          f"  collective and decompression {1e3 * (c.cpu - c.compress_cpu):6.2f}")
    if c.offload:
        offloaded += c.compress_cpu
    else:
        on_thread += c.compress_cpu
    rest += c.cpu - c.compress_cpu
total = ustep.cpu + on_thread + offloaded + rest
print(f"training thread {1e3 * (ustep.cpu + on_thread):.2f} ms, offloaded {1e3 * offloaded:.2f}, "
      f"collectives and decompression {1e3 * rest:.2f}; total {1e3 * total:.2f} ms = {total / ref:.2f} references")
