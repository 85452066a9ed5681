"""Run a rank body of the Join test on 2 ranks again and again (each run with a 20 s limit) until one
overruns or the time is up: `python docs/results/join-teardown/loop.py whole|sparcoll_part COUNT
SECONDS`, from the project root."""
import sys
import time

sys.path[:0] = ["tests", "docs/results/join-teardown"]
from ranks import run_ranks     # noqa: E402  (after the path)
import bodies                   # noqa: E402

if __name__ == "__main__":
    body, n, limit = getattr(bodies, sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    start = time.monotonic()
    for i in range(n):
        if time.monotonic() - start > limit:
            break
        t0 = time.monotonic()
        try:
            run_ranks(body, 2, timeout=20)
        except AssertionError as e:
            print(f"run {i} FAILED after {time.monotonic() - t0:.1f} s\n{e}", flush=True)
            break
    print(f"{i + 1} runs in {time.monotonic() - start:.1f} s", flush=True)
