"""Each alone run of a kept plan: measured step, predicted / measured, and with the prediction scaled by
the run's median reference over the profile's (bench.speed).  python3 summary.py"""
import json
import statistics

for w in ("ncf", "gpt"):
    plan = json.load(open(f"../{w}-plan.json"))
    for i in (1, 2, 3):
        d = json.load(open(f"{w}-plan-{i}.json"))
        (r,) = d["runs"]
        p = r["per_step"]
        timed = [k for k in range(d["warmup"], len(p["step_s"])) if not p["probed"][k]]
        ref = statistics.median(p["reference_cpu_s"][k] for k in timed)
        pred, meas = plan["predicted_step_s"], r["step_s"]
        print(f"{w} run {i}: step {1e3 * meas:.1f} ms (CPU {1e3 * r['cpu_s']:.1f}), predicted {1e3 * pred:.1f}, "
              f"pred / meas {pred / meas:.2f}, reference {1e3 * ref:.3f} ms (profile {1e3 * plan['reference_cpu_s']:.3f}), "
              f"at the run's speed {pred * ref / plan['reference_cpu_s'] / meas:.2f}")
