"""The plan against each uniform strategy, step by step, in the check rounds (W-sparse-check-rN.json)."""
import json, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")       # run from the project root
import plan_summary
out, workload = Path(sys.argv[1]), sys.argv[2]
for f in sorted(out.glob(f"{workload}-sparse-check-r*.json")):
    round_ = json.loads(f.read_text())
    steps = {plan_summary.name_of(r["label"], workload): 1e3 * r["step_s"] for r in round_["runs"]}
    print(f"{f.name}: step ms " + ", ".join(f"{k} {v:.1f}" for k, v in steps.items()))
    print("  the plan against " + plan_summary.paired(out, workload, round_))
