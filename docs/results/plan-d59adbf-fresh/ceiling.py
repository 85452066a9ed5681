"""How fast any plan could be on a stored profile: the kept plan's and uniform sparse's units priced as stored
(simulate, as `sparcoll plan` prices them), then again with every unit's communication free but the one that
leaves its backward work spared (the table looked up sparse) as the plan has it, then with all free.
From the project root: .venv/bin/python docs/results/plan-d59adbf-fresh/ceiling.py docs/results/plan-4a5aea8-fresh deeplight"""
import json
import sys

from sparcoll.plan import timeline
from sparcoll.plan.command import priced_as_stored

here, workload = sys.argv[1], sys.argv[2]
profile = json.load(open(f"{here}/{workload}-profile.json"))
for mode in ("plan", "u-sparse"):
    plan = json.load(open(f"{here}/{workload}-{mode}.json"))
    step, tensors, chosen = priced_as_stored(profile, plan)
    costs = [t.costs[o] for t, o in zip(tensors, chosen)]
    step_ms = lambda cs: 1e3 * (timeline.simulate(step, cs).iteration + step.forward)   # noqa: E731
    print(f"{workload} {mode}: {step_ms(costs):.1f} ms; the step's own CPU {1e3 * step.cpu:.1f} ms a worker "
          f"on {step.cores} cores")
    for o, c in zip(chosen, costs):
        print(f"  {str(o):28s} channel {1e3 * c.comm:6.2f} ms, CPU beside training {1e3 * c.in_training:6.2f} ms, "
              f"on the training thread {1e3 * c.compress:6.2f} ms")
    spared = [i for i, c in enumerate(costs) if c.compress < 0]
    for keep, what in ((spared, "the spared units as they are, every other unit free"), ([], "every unit free")):
        free = [c if i in keep else timeline.Cost() for i, c in enumerate(costs)]
        print(f"  {what}: {step_ms(free):.1f} ms")
