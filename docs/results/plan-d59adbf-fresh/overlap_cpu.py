"""Each stored round's modes re-priced by their profile: the CPU bound as sparcoll prices it ("now"), and with
each collective's CPU at its rate beside training only for the share of its time that overlaps backward, at its
rate alone after ("new"); against each run's measured step (docs/benchmarks-log.md, section 7, "gpt and vgg on fresh
profiles again"). A one-off; not the project's model.
From the project root: .venv/bin/python docs/results/plan-d59adbf-fresh/overlap_cpu.py docs/results/plan-4a5aea8-fresh \
  docs/results/plan-4a5aea8-interleaved docs/results/plan-lookup-cpu docs/results/plan-lookup-spared \
  docs/results/plan-dc528c2-modes docs/results/plan-8995f01-modes docs/results/plan-kept-modes"""
import json, sys, statistics
from pathlib import Path
sys.path.insert(0, "benchmarks")
from plan_summary import runs_by_plan
from sparcoll.plan.command import priced_as_stored
from sparcoll.plan import timeline

def beside_share(t, costs):
    out = []
    for s, e in zip(t.comm_start, t.comm_end):
        out.append(0.0 if e <= s else max(0.0, min(e, t.backward_end) - s) / (e - s))
    return out

def overlap_bound(step, costs, share):
    cpu = sum(c.cpu + (c.in_training - c.cpu) * f for c, f in zip(costs, share))
    return (step.cpu + cpu) / step.cores - step.forward

def price(step, costs, variant):
    t = timeline.simulate(step, costs)
    if variant == "now" or not step.shares_cores:
        return t.iteration, t
    share = beside_share(t, costs)
    waited = max(t.backward_end, max(t.comm_end, default=0))  # approx (gloo/lane included in comm_end)
    return max(waited + step.optimizer, overlap_bound(step, costs, share) + t.idle), t

rows = []
for d in sys.argv[1:]:
    d = Path(d)
    for prof in d.glob("*-profile.json"):
        w = prof.name.removesuffix("-profile.json")
        profile = json.loads(prof.read_text())
        for name, runs in runs_by_plan(d, w).items():
            f = d / name
            if not f.exists():
                continue
            plan = json.loads(f.read_text())
            try:
                step, tensors, chosen = priced_as_stored(profile, plan)
            except Exception as exc:
                print("skip", f, exc); continue
            costs = [t.costs[o] for t, o in zip(tensors, chosen)]
            now, _ = price(step, costs, "now")
            new, _ = price(step, costs, "overlap")
            meas = [r["step_s"] for r in runs]
            fw = step.forward
            rows.append((str(d.name), w, name, plan.get("predicted_step_s"), now + fw, new + fw, meas))
for d, w, name, stored, now, new, meas in rows:
    r = lambda p: "/".join(f"{p/m:.2f}" for m in meas)
    print(f"{d:28s} {w:9s} {name[:34]:34s} stored {stored*1e3:6.1f} now {now*1e3:6.1f} new {new*1e3:6.1f} "
          f"meas {'/'.join(f'{m*1e3:.0f}' for m in meas):18s} now {r(now)}  new {r(new)}")
