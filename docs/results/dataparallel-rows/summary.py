"""Per commit and round: DataParallel's and DDP's step, DDP's communication share of its step, and
from the synchronization logs (ranks' medians over the steps after the first 5; "-" for a run without them, ab.sh's) when the step's first
collective of gradients started after its first gradient and how long the rows' round held the
synchronization thread.
    python3 docs/results/dataparallel-rows/summary.py OUT"""
import collections
import glob
import json
import re
import statistics
import sys

out = sys.argv[1]
rows = collections.defaultdict(list)
for path in sorted(glob.glob(f"{out}/*-r*.json")):
    match = re.match(r".*/(\w+)-r(\d+)\.json$", path)
    if match is None:               # a synchronization log
        continue
    commit, rnd = match.groups()
    runs = {r["comm"]: r for r in json.load(open(path))["runs"]}
    dp, ddp = runs["poseidon"]["step_s"] * 1e3, runs["ddp"]["step_s"] * 1e3
    share = runs["ddp"]["comm_s"] / runs["ddp"]["step_s"]
    held, first = [], []
    for log in glob.glob(f"{out}/{commit}-r{rnd}-sync-*.json"):
        steps = collections.defaultdict(list)
        arm = None
        for what, start, seconds in json.load(open(log)):
            if what == "rows" or arm is None or start < steps[arm][-1][1]:
                arm = len(steps)            # a step's items, in the order the thread ran them
            steps[arm].append((what, start, seconds))
        items = [v for k, v in sorted(steps.items())][5:]
        held.append(statistics.median(sum(s for w, _, s in v if w == "rows") for v in items))
        first.append(statistics.median(min((t for w, t, _ in v if w != "rows"), default=float("nan")) for v in items))
    rows[commit].append((int(rnd), dp, ddp, share, held, first))
print("| commit | round | DataParallel ms | DDP ms | x DDP | DDP comm share | rows round, ms on the thread (per rank) | first gradients' collective starts, ms after the first gradient (per rank) |")
print("|---|---:|---:|---:|---:|---:|---|---|")
for commit, rs in rows.items():
    for rnd, dp, ddp, share, held, first in sorted(rs):
        print(f"| {commit} | {rnd} | {dp:.1f} | {ddp:.1f} | {ddp / dp:.2f} | {100 * share:.0f}% | "
              f"{', '.join(f'{h * 1e3:.1f}' for h in held) or '-'} | "
              f"{', '.join(f'{f * 1e3:.1f}' for f in first) or '-'} |")
