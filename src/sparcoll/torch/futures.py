"""Turn the completion of sparcoll and torch collectives into torch Futures that C++ callers can read.

`torch.futures.Future.set_exception` does not fail a future: it stores the exception as the future's
value and only Python unwraps it, so DDP's reducer (C++) takes it for a tensor list: in torch 2.13 a
future completed that way inside DDP's backward crashed the process with SIGSEGV. An exception raised
inside a `then` callback does fail the chained future for C++ readers too, so every future handed out
here is a `then` of the one completed internally.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

import sparcoll


def _future_error(future: torch.futures.Future) -> BaseException | None:
    try:
        future.value()   # completed: raises its error without blocking
    except Exception as exc:
        return exc
    return None


def when_done(source, fn: Callable[[BaseException | None], None]) -> None:
    """Call fn(error or None) once `source` (a sparcoll Work, a torch Work or a torch Future)
    finishes, from whichever thread finishes it."""
    if isinstance(source, sparcoll.Work):
        source.add_done_callback(lambda work: fn(work.exception()))
        return
    future = source.get_future() if isinstance(source, dist.Work) else source
    future.add_done_callback(lambda done: fn(_future_error(done)))


class Completion:
    """Completes `future` with `value` once every source has finished, or fails it with the first
    error. Never blocks: it is driven by the sources' completion callbacks."""

    def __init__(self, value: Any, sources=(), error: BaseException | None = None):
        self.value = value
        self.error = error
        # When waiting without a timeout must give up: the latest deadline of the sparcoll Works
        # among the sources (torch's own works have their group's timeout), None if there are none.
        self._works = [s for s in sources if isinstance(s, sparcoll.Work)]
        self.deadline = max((w.deadline for w in self._works), default=None)
        self.done = threading.Event()
        self._inner = torch.futures.Future()
        self.future = self._inner.then(self._unwrap)
        self._lock = threading.Lock()
        self._pending = len(sources)
        if not sources:
            self._finish()
        for source in sources:
            when_done(source, self._source_done)

    @classmethod
    def start(cls, value: Any, issue: Callable[[], list]) -> "Completion":
        """Run issue() (which starts the collectives and returns their handles); an exception it
        raises fails the completion instead of escaping into the caller (e.g. DDP's backward)."""
        try:
            sources = issue()
        except Exception as exc:
            return cls(value, error=exc)
        return cls(value, sources)

    def give_up(self, error: BaseException) -> None:
        """Its waiter gave up at the deadline: no sparcoll collective of it may run after that."""
        for work in self._works:
            work.give_up(error)

    def _source_done(self, error: BaseException | None) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
            self._pending -= 1
            last = self._pending == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        self._inner.set_result(self.value)
        self.done.set()     # after the future: wait() returning means the future is complete too

    def _unwrap(self, inner: torch.futures.Future) -> Any:
        if self.error is not None:
            raise self.error
        return inner.value()
