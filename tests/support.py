"""Plain helpers several test files need: polling with a deadline, a function on a few threads, a
`sparcoll` command run in the test's process, a dedicated aggregator process, block-sparse test
data. (Fixtures are in conftest.py; what ranks in processes of their own run is in scenarios.py.)"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import traceback

import numpy as np
import torch

from sparcoll.errors import SparcollError


def wait_for(predicate, limit: float = 5.0) -> bool:
    """Poll `predicate` until it holds or `limit` seconds pass; its last value."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def descendants(pid: int) -> set[int]:
    """Every process below `pid` now (also those that started sessions of their own)."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc` and every process below it, and collect `proc`."""
    for pid in descendants(proc.pid) | {proc.pid}:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=10)


def on_threads(fn, count: int, timeout: float = 30.0) -> None:
    """fn(i) for i in range(count), each on its own thread (in-process ranks); every thread is joined
    with a deadline and any exception is raised here."""
    errors = []

    def run(i):
        try:
            fn(i)
        except BaseException as exc:   # reported in the test's thread below
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    join_all(threads, timeout)
    assert not errors, errors


def outcome_of(fn, expected=(SparcollError,)) -> tuple[str, str, float]:
    """(the exception's type name, its text, seconds) for an error of the `expected` types;
    ("UNEXPECTED <name>", ...) for another exception, ("NO ERROR", "", seconds) for none."""
    t = time.monotonic()
    try:
        fn()
    except expected as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t
    except Exception as exc:
        return f"UNEXPECTED {type(exc).__name__}", str(exc), time.monotonic() - t
    return "NO ERROR", "", time.monotonic() - t


def join_all(threads: list[threading.Thread], timeout: float) -> None:
    """Join `threads` within one `timeout`; AssertionError with every thread's stack if any is left."""
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, f"threads {stuck} still running after {timeout} s\n{every_threads_stack()}"


def every_threads_stack() -> str:
    """Every thread's current Python stack in this process (the library's threads too), by name."""
    frames = sys._current_frames()
    return "\n".join(f"--- {t.name}:\n" + "".join(traceback.format_stack(frames[t.ident]))
                     for t in threading.enumerate() if t.ident in frames)


def sparcoll_here(capture, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`sparcoll ARGV` run in this process, reported as a process of its own would be: its exit
    status, and stdout and stderr from `capture` (the test's capsys or capfd). Its jobs fork from this
    session's fork server (sparcoll/bench/forked.py), where a process of its own would first import
    torch twice, itself and its fork server: 4-8 s of a test on 2 cores (a test sets the command's
    environment with monkeypatch). After `timeout` seconds it is interrupted as Ctrl-C would (the
    launcher stops its children and removes its network), and the test fails."""
    from sparcoll.cli import main

    expired = []

    def expire(signum, frame):
        expired.append(True)
        raise KeyboardInterrupt

    terminate, alarm = signal.getsignal(signal.SIGTERM), signal.signal(signal.SIGALRM, expire)
    outer, started = signal.setitimer(signal.ITIMER_REAL, timeout)[0], time.monotonic()   # pytest-timeout's
    try:
        status = main([str(arg) for arg in argv])
    except SystemExit as exc:           # the parser's refusals
        status = exc.code
    except KeyboardInterrupt:
        if not expired:
            raise
        status = 130
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, alarm)
        if outer:                           # the test's own deadline runs on
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 0.001))
        signal.signal(signal.SIGTERM, terminate)    # main() turns SIGTERM into an interrupt
    out = capture.readouterr()
    assert not expired, f"sparcoll {' '.join(map(str, argv))} did not finish within {timeout:g} s\n{out.err[-3000:]}"
    return subprocess.CompletedProcess(argv, status, out.out, out.err)


def start_aggregator(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`sparcoll aggregator --port 0 ARGS` as a process; returns it and the address it printed."""
    proc = subprocess.Popen([sys.executable, "-m", "sparcoll", "aggregator", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"})
    line = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout=60)
    if not line or "listening on" not in line[0]:
        stop(proc)
        raise RuntimeError(f"aggregator did not start: {line}")
    return proc, line[0].split()[-1]


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def block_sparse(rng: torch.Generator, nblocks, block_size, density):
    """Integer-valued data (sums are exact in any order) with a random set of non-zero blocks; the
    data, shape (nblocks, block_size), and the indices of its non-zero blocks."""
    data = torch.randint(-4, 5, (nblocks, block_size), generator=rng).float()
    data[data == 0] = 1.0
    keep = torch.rand(nblocks, generator=rng) < density
    data[~keep] = 0.0
    return data, np.flatnonzero(keep.numpy())


def error_chain(exc: BaseException) -> str:
    """An exception and its causes, as one line (at most 6 links)."""
    parts = []
    while exc is not None and len(parts) < 6:
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return " <- ".join(parts)
