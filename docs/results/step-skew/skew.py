"""Per step of the phase logs (phases.patch: each rank's step start and end on the host's one clock, and
its process CPU), over the timed steps after 4: the slowest rank's step (what `sparcoll train` reported
until this change), the ranks' mean step (what it reports now), the last start to the last end, how far
apart the ranks start and end their steps, the time from a rank's step to its next (the period: the step
and the reports between steps) and the ranks' mean CPU in a step; and how long the cores stood idle by
the slowest and by the mean step (step - 2 x mean CPU: 4 workers on 2 cores). Medians, p10 and p90.
Usage: skew.py PREFIX (e.g. docs/results/step-skew/ph-ncf)"""
import json
import statistics as st
import sys

prefix = sys.argv[1]
ranks = [[json.loads(line) for line in open(f"{prefix}-{r}.jsonl")] for r in range(4)]
rows = []
for i in range(4, len(ranks[0]) - 1):
    steps = [ranks[r][i] for r in range(4)]
    starts, ends = [s[9] for s in steps], [s[10] for s in steps]
    cpu = st.fmean(s[2] + s[4] + s[6] for s in steps)
    windows = [e - s for s, e in zip(starts, ends)]
    rows.append({"slowest": max(windows), "mean": st.fmean(windows), "together": max(ends) - max(starts),
                 "start_skew": max(starts) - min(starts), "end_skew": max(ends) - min(ends),
                 "period": st.fmean(ranks[r][i + 1][9] - starts[r] for r in range(4)), "cpu": cpu,
                 "idle_slowest": max(windows) - 2 * cpu, "idle_mean": st.fmean(windows) - 2 * cpu})
for key in rows[0]:
    v = sorted(1e3 * row[key] for row in rows)
    print(f"{key:12} median {st.median(v):6.1f} p10 {v[len(v) // 10]:6.1f} p90 {v[9 * len(v) // 10]:6.1f} ms")
