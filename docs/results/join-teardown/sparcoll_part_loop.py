import sys, time
sys.path[:0] = ["tests", "docs/results/join-teardown"]
from ranks import run_ranks
import sparcoll_part_body
if __name__ == "__main__":
    n, limit = int(sys.argv[1]), float(sys.argv[2])
    start = time.monotonic()
    for i in range(n):
        if time.monotonic() - start > limit:
            break
        t0 = time.monotonic()
        try:
            run_ranks(sparcoll_part_body.sparcoll_only, 2, timeout=20)
        except AssertionError as e:
            print(f"run {i} FAILED after {time.monotonic() - t0:.1f} s\n{e}", flush=True)
            break
    print(f"{i + 1} runs in {time.monotonic() - start:.1f} s", flush=True)
