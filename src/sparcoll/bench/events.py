"""How a job's rank 0 reports to the launcher: one JSON event per line on stdout, prefixed with
EVENT_PREFIX so that stray library output cannot be mistaken for an event.

Both sides import this module: the workers (bench/worker.py, train/worker.py) to emit, the launcher
(launch.py) to decode. It is light on purpose (no torch), so the launcher does not load a worker's
dependencies.
"""
from __future__ import annotations

import contextlib
import json

EVENT_PREFIX = "@sparcoll-bench "


def emit(event: dict) -> None:
    print(EVENT_PREFIX + json.dumps(event), flush=True)


def decode(line: bytes) -> dict | None:
    """The event a line of a worker's stdout carries, or None if it is other output."""
    prefix = EVENT_PREFIX.encode()
    return json.loads(line[len(prefix):]) if line.startswith(prefix) else None


@contextlib.contextmanager
def reporting(rank: int):
    """Rank 0 tells the launcher how the job ended: a "done" event, or an "error" event (then the
    exception goes on, so the process fails too)."""
    try:
        yield
    except Exception as exc:
        if rank == 0:
            emit({"event": "error", "message": f"{type(exc).__name__}: {exc}"})
        raise
    if rank == 0:
        emit({"event": "done"})
