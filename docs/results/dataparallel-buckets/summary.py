"""Per workload, network and commit: DataParallel's and DDP's step (ms, range over rounds) and the
ratio DDP / DataParallel per round.  python3 summary.py DIR"""
import collections
import json
import pathlib
import sys

rows = collections.defaultdict(list)
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    workload, net, commit, _ = f.stem.split("-")
    runs = {r["label"]: r for r in json.loads(f.read_text())["runs"]}
    rows[workload, net, commit].append((runs["poseidon"]["step_s"] * 1e3, runs["ddp"]["step_s"] * 1e3,
                                        runs["ddp"]["comm_s"] / runs["ddp"]["step_s"]))
print("| workload | network | commit | DataParallel ms | DDP ms | x DDP per round | DDP comm share |")
print("|---|---|---|---:|---:|---|---:|")
for (workload, net, commit), r in rows.items():
    dp, ddp, share = zip(*r)
    print(f"| {workload} | {net} | {commit} | {min(dp):.1f}-{max(dp):.1f} | {min(ddp):.1f}-{max(ddp):.1f} | "
          f"{', '.join(f'{b / a:.2f}' for a, b, _ in r)} | {100 * min(share):.0f}-{100 * max(share):.0f}% |")
