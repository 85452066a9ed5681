"""The chance that a dense kind keeps the sparse path with k trials per path, resampling the trial
times of the idle runs here (rank 0's, as if independent; the decision: the sparse path's best under
0.9 x the ring's best).  python3 resample.py"""
import ast
import pathlib
import random

here = pathlib.Path(__file__).parent
times = {"sparse": [], "ring": []}
for name, skip in (("two-trials.txt", range(3, 13)), ("three-trials.txt", ())):   # runs 4-13 were loaded
    for i, line in enumerate((here / name).read_text().splitlines()):
        if i not in skip:
            for path, ts in ast.literal_eval(line.split(" ", 2)[2]).items():
                times[path] += ts
rng = random.Random(0)
print(f"{len(times['sparse'])} sparse and {len(times['ring'])} ring trial times")
for k in (2, 3, 4):
    n = 200_000
    kept = sum(min(rng.choice(times["sparse"]) for _ in range(k)) < 0.9 * min(rng.choice(times["ring"]) for _ in range(k))
               for _ in range(n))
    print(f"{k} trials per path: the sparse path kept in {100 * kept / n:.2f}% of kinds")
