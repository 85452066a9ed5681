"""The predictions of each profile here and the step's CPU and forward it measured (run from this directory)."""
import json
from pathlib import Path

print(f"{'profile':8} {'code':>6} {'plan':>6} {'bound':>6} {'blocktopk':>9} {'sparse':>6} {'efsignsgd':>9} {'step CPU':>8} {'forward':>7}")
for kind in ("old", "new", "mean"):
    for plan_file in sorted(Path(".").glob(f"j-{kind}-*.json")):
        n = plan_file.stem.split("-")[-1]
        plan, profile = json.loads(plan_file.read_text()), json.loads(Path(f"p-{kind}-{n}.json").read_text())
        u = {k: v * 1e3 for k, v in plan["uniform"].items()}
        print(f"{kind + '-' + n:8} {profile['version']:>6} {plan['predicted_step_s'] * 1e3:6.1f} "
              f"{plan['cpu_bound_s'] * 1e3:6.1f} {u['blocktopk:0.01']:9.1f} {u['sparse']:6.1f} {u['efsignsgd']:9.1f} "
              f"{profile['model']['cpu'] * 1e3:8.2f} {profile['model']['forward'] * 1e3:7.2f}")

# stepcpu.txt: per window of 12 steps, the busiest worker's median CPU per step and the workers' mean
rows = [line.split() for line in Path("stepcpu.txt").read_text().splitlines() if "cpu max" in line]
for label, column in (("busiest worker", 4), ("workers' mean", 6)):
    values = sorted(float(r[column]) for r in rows)
    n, mean = len(values), sum(float(r[column]) for r in rows) / len(rows)
    cv = (sum((v - mean) ** 2 for v in values) / n) ** 0.5 / mean
    print(f"step CPU, {label}: {n} windows, median {values[n // 2]:.2f} ms, 10th-90th percentile "
          f"{values[n // 10]:.2f}-{values[9 * n // 10]:.2f}, range {values[0]:.2f}-{values[-1]:.2f}, "
          f"coefficient of variation {cv:.2f}")
