"""Per workload, version and strategy: ms per step per round, x DDP of the same run, and DDP's
communication share.   python3 summarize_plans.py [DIR]"""
import glob
import json
import os
import sys

here = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "plans")
for workload in ("deeplight", "ncf"):
    for version in ("old", "new"):
        table: dict = {}
        for path in sorted(glob.glob(f"{here}/{workload}-{version}-r*.json")):
            runs = json.load(open(path))["runs"]
            ddp = next(r for r in runs if r["label"] == "ddp")
            for r in runs:
                name = "ddp" if r["label"] == "ddp" else r["label"].rsplit("true-", 1)[-1].removesuffix(".json")
                table.setdefault(name, []).append((r["step_s"] * 1e3, ddp["step_s"] / r["step_s"],
                                                   ddp["comm_s"] / ddp["step_s"]))
        for name, rows in table.items():
            line = f"{workload:9s} {version} {name:6s} " + ", ".join(f"{ms:.1f}" for ms, _, _ in rows) + " ms"
            if name == "ddp":
                line += "; communication " + ", ".join(f"{share:.0%}" for _, _, share in rows)
            else:
                line += "; x DDP " + ", ".join(f"{x:.2f}" for _, x, _ in rows)
            print(line)
