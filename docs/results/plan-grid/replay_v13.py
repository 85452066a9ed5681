"""The stored version-13 profiles of docs/results/plan-left-running refitted by this version: their sparse
AllReduce points given their elements by the order the profiler emitted them (SPARSE_NUMELS outer,
SPARSE_DENSITIES inner), written to OUT_DIR for benchmarks/contention_predict.py.
    python3 docs/results/plan-grid/replay_v13.py OUT_DIR docs/results/plan-left-running/*-profile.json
"""
import json
import sys
from pathlib import Path
from sparcoll.plan.profiler import SPARSE_NUMELS, SPARSE_DENSITIES, fit
for f in sys.argv[2:]:
    p = json.loads(Path(f).read_text())
    for kind in ("collectives", "loaded", "slowdown"):
        pts = [e for e in p["points"] if e.get("kind") == kind and e.get("what") == "sparse" and not e.get("tensor")]
        assert len(pts) == len(SPARSE_NUMELS) * len(SPARSE_DENSITIES), len(pts)
        for i, e in enumerate(pts):
            e["numel"] = SPARSE_NUMELS[i // len(SPARSE_DENSITIES)]
            assert e["x"] <= e["numel"] * 4 + 1
    p["fits"] = fit(p["points"])
    p["version"] = 14
    (Path(sys.argv[1]) / Path(f).name).write_text(json.dumps(p))
