"""The machine's own speed over time: the same piece of CPU work (200 float32 matmuls of 256 x 256, one
thread) timed once a second in each of PROCESSES processes for SECONDS seconds, on an otherwise idle
machine. The work takes well under a second, so the cores stay mostly idle: what varies is the
machine, not the load. Prints one line per sample (seconds since the start, process, ms) and a summary.

    .venv/bin/python benchmarks/machine_speed.py PROCESSES SECONDS
"""
import multiprocessing
import os
import queue
import statistics
import sys
import time

MATMULS = 200
SIZE = 256


def sample(results: multiprocessing.Queue, seconds: float) -> None:
    import torch
    torch.set_num_threads(1)
    a, b = torch.randn(SIZE, SIZE), torch.randn(SIZE, SIZE)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        for _ in range(MATMULS):
            a @ b
        took = time.perf_counter() - start
        results.put((time.time(), os.getpid(), 1e3 * took))
        time.sleep(max(0.0, 1.0 - took))


def main() -> None:
    processes, seconds = int(sys.argv[1]), float(sys.argv[2])
    results: multiprocessing.Queue = multiprocessing.Queue()
    workers = [multiprocessing.Process(target=sample, args=(results, seconds), daemon=True)
               for _ in range(processes)]
    for w in workers:
        w.start()
    began, times = time.time(), []
    deadline = time.monotonic() + seconds + 60
    while time.monotonic() < deadline and (any(w.is_alive() for w in workers) or not results.empty()):
        try:
            at, pid, ms = results.get(timeout=2)
        except queue.Empty:
            continue
        times.append(ms)
        print(f"{at - began:7.1f} {pid} {ms:8.2f}", flush=True)
    for w in workers:
        w.join(timeout=5)
        if w.is_alive():
            w.kill()
    times.sort()
    median = statistics.median(times)
    near = sum(abs(t / median - 1) <= 0.1 for t in times) / len(times)
    print(f"# {len(times)} samples of {MATMULS} matmuls of {SIZE} x {SIZE} in {processes} process(es) over "
          f"{seconds:.0f} s: min {times[0]:.1f} ms, p10 {times[len(times) // 10]:.1f}, median {median:.1f}, "
          f"p90 {times[9 * len(times) // 10]:.1f}, max {times[-1]:.1f}; p90 / p10 "
          f"{times[9 * len(times) // 10] / times[len(times) // 10]:.2f}; {100 * near:.0f}% within 10% of the median")


if __name__ == "__main__":
    main()
