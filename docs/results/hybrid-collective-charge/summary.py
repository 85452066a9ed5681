"""Per workload and commit: DataParallel's and DDP's step per round, the ratio, which strategies
DataParallel's trace shows, and DDP's communication share of its step.    python3 docs/results/hybrid-collective-charge/summary.py OUT"""
import collections
import glob
import json
import re
import sys

rows = collections.defaultdict(list)
for path in glob.glob(f"{sys.argv[1]}/*-r*.json"):
    workload, commit, rnd = re.match(r".*/(\w+)-(\w+)-r(\d+)\.json$", path).groups()
    runs = {r["comm"]: r for r in json.load(open(path))["runs"]}
    dp = runs["poseidon"]
    used = sorted({t[1] for t in dp["trace"]["tensors"]})
    rows[workload, commit].append((int(rnd), dp["step_s"] * 1e3, runs["ddp"]["step_s"] * 1e3, used,
                                   runs["ddp"]["comm_s"] / runs["ddp"]["step_s"]))
print("| workload | commit | DataParallel ms | DDP ms | x DDP per round | strategies used | DDP comm share |")
print("|---|---|---:|---:|---|---|---:|")
for (workload, commit), rs in sorted(rows.items()):
    rs.sort()
    print(f"| {workload} tiny | {commit} | {min(r[1] for r in rs):.1f}-{max(r[1] for r in rs):.1f} | "
          f"{min(r[2] for r in rs):.1f}-{max(r[2] for r in rs):.1f} | "
          f"{', '.join(f'{r[2] / r[1]:.2f}' for r in rs)} | {', '.join(sorted({s for r in rs for s in r[3]}))} | "
          f"{100 * min(r[4] for r in rs):.0f}-{100 * max(r[4] for r in rs):.0f}% |")
