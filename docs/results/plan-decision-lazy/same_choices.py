"""One-off: every decision of benchmarks/plan_decision.py (48 settings), pickled to compare two commits:
    PYTHONPATH=WT/src python3 docs/results/plan-decision-lazy/same_choices.py OUT.pkl  (from the repository root)"""
import sys, json, itertools, pickle
sys.path.insert(0, "benchmarks")
from pathlib import Path
import plan_decision as P
from sparcoll.plan import decide
from sparcoll.plan.command import choices_of, tensors_of, units_of
from sparcoll.plan.costs import Costing
from sparcoll.plan.options import JobFacts
dirs = ["docs/results/plan-passes","docs/results/plan-passes-gpt-vgg","docs/results/plan-coo-units"]
profiles = {p.name.removesuffix("-profile.json"): json.loads(p.read_text()) for d in map(Path, dirs) for p in sorted(d.glob("*-profile.json"))}
profiles = {k: v for k, v in profiles.items() if "fits" in v}
out = {}
def run(name, step, measured, costing, comps):
    for grouped, offload in itertools.product((True, False), repeat=2):
        s, units, groups = (units_of(step, measured) if grouped else (step, measured, [[i] for i in range(len(measured))]))
        tensors = choices_of(units, groups, measured, costing, comps, JobFacts(offload_core=offload))
        res = decide.plan(s, tensors)
        out[(name, grouped, offload)] = repr(res)
for name, prof in profiles.items():
    step, measured = tensors_of(prof)
    run(name, step, measured, Costing(prof["fits"], prof["workers"]), P.compressors_of(prof))
base = profiles["vgg"]
for count in (10, 32, 150, 300, 314):
    step, measured = P.resnet_instance(count)
    run(f"resnet{count}", step, measured, Costing(base["fits"], base["workers"]), P.compressors_of(base))
pickle.dump(out, open(sys.argv[1], "wb"))
print(len(out))
