"""Per workload and version: DataParallel (the ring for every tensor) and DDP in the same run, ms
per step, and their ratio, per round.   python3 summarize.py [DIR]"""
import glob
import json
import os
import sys

here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
for workload in ("deeplight", "ncf"):
    for version in ("old", "new"):
        rows = []
        for path in sorted(glob.glob(f"{here}/{workload}-{version}-r*.json")):
            runs = {("ddp" if r["label"] == "ddp" else "dp"): r for r in json.load(open(path))["runs"]}
            dp, ddp = runs["dp"]["step_s"] * 1e3, runs["ddp"]["step_s"] * 1e3
            rows.append((dp, ddp, ddp / dp, runs["dp"]["comm_s"] * 1e3,
                         runs["ddp"]["comm_s"] / runs["ddp"]["step_s"]))
        if rows:
            print(f"{workload:9s} {version}: DataParallel " + ", ".join(f"{r[0]:.1f}" for r in rows)
                  + " ms; DDP " + ", ".join(f"{r[1]:.1f}" for r in rows)
                  + " ms; x DDP " + ", ".join(f"{r[2]:.2f}" for r in rows)
                  + "; DataParallel sync " + ", ".join(f"{r[3]:.1f}" for r in rows) + " ms"
                  + "; DDP's communication share " + ", ".join(f"{r[4]:.0%}" for r in rows))
