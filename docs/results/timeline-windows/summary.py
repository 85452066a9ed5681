"""ab.sh's profiles and runs: per profile its step's parts (forward, backward's end, optimizer; ms) and
their sum, a step's CPU, the prediction (CPU bound or timeline), the run's measured step and predicted / measured.
From the project root: .venv/bin/python docs/results/timeline-windows/summary.py"""
import glob
import json
import os
import statistics

here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ab")
ratios: dict[str, list[float]] = {}
sums: dict[str, list[float]] = {}
for code in ("before", "after"):
    for path in sorted(glob.glob(os.path.join(here, f"{code}-*-plan.json"))):
        stem = path[:-len("-plan.json")]
        plan, m = json.load(open(path)), json.load(open(stem + "-profile.json"))["model"]
        pred, cpu, idle = plan["predicted_step_s"], plan["cpu_bound_s"], plan["idle_s"]
        sums.setdefault(code, []).append(1e3 * (m["forward"] + m["backward_end"] + m["optimizer"]))
        kind = "CPU bound" if cpu + idle >= pred * (1 - 1e-9) else "timeline"
        parts = " ".join(f"{1e3 * m[k]:.2f}" for k in ("forward", "backward_end", "optimizer", "cpu"))
        windows = "; ".join(" ".join(f"{1e3 * w[k]:.2f}" for k in ("forward", "backward_end", "optimizer", "cpu"))
                            for w in m.get("windows", []))
        parts += f", sum {1e3 * (m['forward'] + m['backward_end'] + m['optimizer']):.2f}"
        line = f"{os.path.basename(stem)}: forward/backward end/optimizer/step CPU {parts}"
        line += f" (windows {windows})" if windows else ""
        line += f"; predicted {1e3 * pred:.1f} ms ({kind})"
        try:
            run = json.load(open(stem + "-planned.json"))["runs"][0]
            ratio = pred / run["step_s"]
            ratios.setdefault(code, []).append(ratio)
            line += f", measured {1e3 * run['step_s']:.1f}, predicted / measured {ratio:.2f}"
        except FileNotFoundError:
            pass
        print(line)
for code, values in ratios.items():
    print(f"{code}: predicted / measured {min(values):.2f}-{max(values):.2f} (median {statistics.median(values):.2f}); "
          f"forward, backward and optimizer {min(sums[code]):.1f}-{max(sums[code]):.1f} ms")
