"""Buffer lifetimes: a Lease is memory lent to someone else, given back exactly once.

Memory that crosses a thread boundary without a copy (the user's tensor, a reused receive buffer) is
lent, and its owner may reuse it only once the lease is back. One concept serves every such place:
  - a message queued on a connection: back once its bytes are written (or dropped with the connection);
  - a contribution handed to an aggregator: back once the aggregator no longer reads or sums into it;
  - a result whose sums live in a contribution's memory, sent to every worker: `shared` gives each
    worker its own share, and the contribution's lease is back once every worker had the result;
  - a worker's tensor lent to its own colocated aggregator: `Loans` counts them, and the collective
    completes only once every lease is back (the aggregator may still send peers sums from it).
"""
from __future__ import annotations

import threading
from typing import Callable


class Lease:
    """Calls `on_return` once it has been given back `count` times, from any threads (at once when
    `count` is 0). Give-backs beyond `count` do nothing."""

    __slots__ = ("_on_return", "_count", "_lock")

    def __init__(self, on_return: Callable[[], None] | None = None, count: int = 1):
        self._on_return = on_return
        self._count = count
        self._lock = threading.Lock()
        if count == 0:
            self._fire()

    def give_back(self) -> None:
        with self._lock:
            if self._count <= 0:
                return
            self._count -= 1
            last = self._count == 0
        if last:
            self._fire()

    def _fire(self) -> None:
        on_return, self._on_return = self._on_return, None
        if on_return is not None:
            on_return()

    @classmethod
    def shared(cls, lease: "Lease | None", holders: int) -> "Lease | None":
        """One lease for `holders` borrowers of the memory `lease` covers: `lease` goes back once
        every one of them gave theirs back."""
        return None if lease is None else cls(lease.give_back, holders)


def give_back(lease: Lease | None) -> None:
    """Give a lease back, if there is one (memory nobody waits for is lent without a lease)."""
    if lease is not None:
        lease.give_back()


class Loans:
    """The leases an owner has out on its memory; `wait` returns once every one is back."""

    def __init__(self):
        self._out = 0
        self._lock = threading.Lock()
        self._all_back = threading.Event()
        self._all_back.set()

    def lend(self) -> Lease:
        with self._lock:
            self._out += 1
            self._all_back.clear()
        return Lease(self._returned)

    def _returned(self) -> None:
        with self._lock:
            self._out -= 1
            if self._out == 0:
                self._all_back.set()

    def wait(self, timeout: float) -> bool:
        return self._all_back.wait(timeout)
