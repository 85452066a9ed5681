"""Each mode's mean step and rank 0's mean CPU seconds per step (its process, every thread) in a CSV
written from a run with diag.patch, leaving out the first two steps."""
import csv
import statistics
import sys

rows: dict = {}
for r in csv.DictReader(open(sys.argv[1])):
    if int(r["step"]) >= 2:
        rows.setdefault(r["mode"], []).append((float(r["step_s"]), float(r["cpu_s"])))
for mode, steps in rows.items():
    step = statistics.mean(s for s, _ in steps)
    cpu = statistics.mean(c for _, c in steps)
    print(f"{mode[-40:]:<40} step {1e3 * step:6.1f} ms  CPU {1e3 * cpu:6.1f} ms  CPU / step {cpu / step:.2f}")
