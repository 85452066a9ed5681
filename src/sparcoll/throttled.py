"""Warnings that a flood must not turn into a flood of log lines."""
from __future__ import annotations

import logging
import threading
import time

LOG_INTERVAL = 10.0           # at most one line per this many seconds for each kind of warning


class Throttled:
    """A warning logged to `log` (at `level`) at most once per LOG_INTERVAL, with a count of those held
    back since (failed accepts, refused connections, a job's failed collectives). `count` counts every
    occurrence, logged or not."""

    def __init__(self, log: logging.Logger, level: int = logging.WARNING):
        self.log = log
        self.level = level
        self.count = 0
        self._held = 0
        self._next = 0.0
        self._lock = threading.Lock()

    def warn(self, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.count += 1
            if now < self._next:
                self._held += 1
                return
            held, self._held, self._next = self._held, 0, now + LOG_INTERVAL
        self.log.log(self.level, "%s%s", message, f" ({held} more like it not logged in the last "
                                                  f"{LOG_INTERVAL:g} s)" if held else "")
