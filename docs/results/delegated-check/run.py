"""Time the "sparcoll" backend's all_reduce that goes to gloo on 2 local ranks (tests/ranks.py):
`python docs/results/delegated-check/run.py cost` (the backend's call against a gloo group's, int64 and
float32) or `... parts` (its two parts alone and together). From the project root, OMP_NUM_THREADS=1."""
import sys
sys.path[:0] = ["tests", "docs/results/delegated-check"]
from ranks import run_ranks
import cost_body
import parts_body

if __name__ == "__main__":
    body = {"cost": cost_body.cost, "parts": parts_body.parts}[sys.argv[1]]
    for rank, rows in enumerate(run_ranks(body, 2, timeout=200)):
        print(f"rank {rank}:", rows)
