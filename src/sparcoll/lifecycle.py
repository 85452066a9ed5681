"""Named states with the moves allowed between them: one place where a state changes, refusing
illegal moves (a bug in sparcoll, never a user's or a peer's mistake)."""
from __future__ import annotations

import enum
from typing import Generic, TypeVar

S = TypeVar("S", bound=enum.Enum)


class IllegalTransition(RuntimeError):
    """sparcoll tried to move a state machine along a move it does not allow: an internal bug."""


class Lifecycle(Generic[S]):
    """The current state of one object and the only function that changes it. Not locked: the
    owner moves it under its own lock."""

    def __init__(self, what: str, initial: S, moves: dict[S, frozenset[S]]):
        self.what = what
        self.state = initial
        self._moves = moves

    def move(self, to: S) -> None:
        if to not in self._moves.get(self.state, frozenset()):
            raise IllegalTransition(f"{self.what}: {self.state.name} -> {to.name} is not allowed")
        self.state = to

    def is_(self, *states: S) -> bool:
        return self.state in states
