"""Each round's step (the ranks' mean), CPU a worker and speed reference, before and after 461a30c:
    .venv/bin/python docs/results/narrow-flags/summary.py docs/results/narrow-flags"""
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
for workload in ("deeplight", "ncf"):
    print(f"{workload}: ms per step (CPU a worker, reference) before -> after, and before / after")
    ratios, per_reference = [], []
    for r in range(1, 100):
        files = [out / f"{workload}-{v}-r{r}.json" for v in ("base", "new")]
        if not all(f.exists() for f in files):
            break
        base, new = (json.loads(f.read_text())["runs"][0] for f in files)
        ratio = base["step_s"] / new["step_s"]
        ratios.append(ratio)
        per_reference.append(ratio * new["reference_cpu_s"] / base["reference_cpu_s"])
        print(f"  round {r}: {base['step_s'] * 1e3:.1f} ({base['cpu_mean_s'] * 1e3:.1f}, "
              f"{base['reference_cpu_s'] * 1e3:.2f}) -> {new['step_s'] * 1e3:.1f} ({new['cpu_mean_s'] * 1e3:.1f}, "
              f"{new['reference_cpu_s'] * 1e3:.2f})  {ratio:.3f}, in references {per_reference[-1]:.3f}")
    if ratios:
        print(f"  before / after: {min(ratios):.3f}-{max(ratios):.3f}, "
              f"in references {min(per_reference):.3f}-{max(per_reference):.3f}")
