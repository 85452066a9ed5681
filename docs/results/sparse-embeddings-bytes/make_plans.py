"""One-off: two hand-made plans for deeplight with sparse embeddings, in the plan format
DataParallel reads (tensors with a unit, a strategy and a placement), in backward's ready order:
the 10 dense tensors of the MLP and the FM's linear part in one unit (blocktopk:0.01 compressed on
the training thread, or gloo's ring), each embedding's COO gradient under the sparse AllReduce,
dense_embedding (208 elements) alone between them.
    .venv/bin/python docs/results/sparse-embeddings-bytes/make_plans.py OUT_DIR"""
import json
import sys
from pathlib import Path

ORDER = ["mlp.6.bias", "mlp.6.weight", "mlp.4.bias", "mlp.4.weight", "mlp.2.bias", "mlp.2.weight",
         "mlp.0.bias", "mlp.0.weight", "bias", "dense_linear", "linear.weight", "dense_embedding",
         "embedding.weight"]
UNIT = {"linear.weight": 1, "dense_embedding": 2, "embedding.weight": 3}


def plan(dense: str) -> dict:
    return {"tensors": [{"name": n, "unit": UNIT.get(n, 0), "placement": "thread",
                         "strategy": "sparse" if n.endswith("embedding.weight") or n == "linear.weight"
                         else dense} for n in ORDER]}


out = Path(sys.argv[1])
(out / "mlp-blocktopk.json").write_text(json.dumps(plan("blocktopk:0.01"), indent=1))
(out / "mlp-ring.json").write_text(json.dumps(plan("ring"), indent=1))
