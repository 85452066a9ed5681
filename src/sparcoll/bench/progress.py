"""A dependency-free progress bar on stderr: redrawn in place on a terminal, one line per step otherwise."""
from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 30


class Progress:
    def __init__(self, total: int, stream: TextIO = sys.stderr):
        self.total, self.done, self.stream = total, 0, stream
        self.start = time.monotonic()
        self.tty = stream.isatty()
        self.what = None

    def advance(self, what: str) -> None:
        """Count one finished step of `what`. Off a terminal, a line is written per new `what` and at
        the end, so logs stay short."""
        self.done += 1
        filled = WIDTH * self.done // max(1, self.total)
        line = (f"[{'#' * filled}{'.' * (WIDTH - filled)}] {self.done}/{self.total} "
                f"{time.monotonic() - self.start:5.0f}s  {what}")
        if self.tty:
            self.stream.write(f"\r{line}\x1b[K")
        elif what != self.what or self.done == self.total:
            self.stream.write(f"{line}\n")
        self.what = what
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.done:
            self.stream.write("\n")
            self.stream.flush()
