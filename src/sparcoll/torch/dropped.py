"""How the ranks of a DataParallel agree on dropping a step whose backward raised.

Autograd never tells the wrapper that a backward raised: the rank finds out at its next forward. It
may drop the step only if every rank's backward raised at the same point (the same collectives
started, in the same order): then their started collectives pair with each other and nothing else
was sent. It says so through the job's torch.distributed Store, beside the collectives, which may be
the very thing that is stuck: "rank r dropped step s after starting n collectives". A rank that
drops a step waits for every rank's word on it; a rank whose backward went through waits for its
collectives and looks, once a second while they do not finish, whether a peer dropped the step it
is finishing or the one before (a rank with nothing left to pair gets one step ahead, no further:
its next step's collectives need the peer). Either way every rank learns within about a second
that the ranks no longer agree, instead of pairing one step's collectives with another's.
"""
from __future__ import annotations

import collections
import time

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from sparcoll.errors import DivergedError

RESTART = "; restart the job (from a checkpoint)"
POLL_S = 0.02                   # how often a dropping rank looks for its peers' word
_instances: collections.Counter = collections.Counter()     # DataParallel wrappers per group


class DroppedSteps:
    """A wrapper's keys in the Store: one per rank and dropped step (how many collectives it started
    in that step), one per dropped step that any rank dropped, and one per step a rank finished that
    a peer dropped."""

    def __init__(self, group, rank: int, world: int):
        name = c10d._get_process_group_name(group if group is not None else dist.group.WORLD)
        _instances[name] += 1          # every rank builds its wrappers in the same order
        self.store = dist.PrefixStore(f"sparcoll/dataparallel/{name}/{_instances[name]}/",
                                      c10d._get_default_store())
        self.rank, self.world = rank, world
        self.last = -1                  # the last step this rank dropped

    def drop(self, step: int, started: int, timeout: float, failed: str = "backward raised") -> None:
        """This rank drops `step`, having started `started` collectives in it (`failed`: what failed,
        in words): returns once every rank dropped it after as many; raises DivergedError if one did
        not (within `timeout`), or gave up on the job (give_up)."""
        self.last = step
        self.store.set(f"{step}/{self.rank}", str(started))
        self.store.add(f"{step}/any", 1)
        everyone = [f"{step}/{r}" for r in range(self.world)]
        deadline = time.monotonic() + timeout
        while not self.store.check(everyone):
            if self.store.check([f"{step}/finished"]):
                raise DivergedError(f"step {step}'s {failed} on rank {self.rank}, but a peer "
                                    f"finished that step: the ranks no longer agree{RESTART}")
            if time.monotonic() > deadline:
                raise DivergedError(f"step {step}'s {failed} on rank {self.rank}; not every "
                                    f"rank said within {timeout} s that its own did{RESTART}")
            time.sleep(POLL_S)
        counts = [int(self.store.get(key)) for key in everyone]
        if len(set(counts)) > 1:
            raise DivergedError(f"step {step}'s {failed} on every rank, at different points: "
                                f"the ranks had started {counts} collectives{RESTART}")

    def give_up(self, step: int) -> None:
        """This rank runs no step after `step` (it is broken): a peer waiting for its collectives of
        that step (or the next) learns it within a second, and one dropping the step at once."""
        self.store.add(f"{step}/any", 1)
        self.store.set(f"{step}/finished", str(self.rank))

    def dropped_by_a_peer(self, step: int) -> str | None:
        """While this rank waits for the collectives of `step`, which its backward went through: the
        error if a peer dropped that step or the one before (which this rank finished), else None."""
        for s in (step, step - 1):
            if s >= 0 and s != self.last and self.store.check([f"{s}/any"]):
                self.store.set(f"{s}/finished", str(self.rank))
                return (f"a peer dropped step {s} (its backward raised, or its synchronization failed), "
                        f"which rank {self.rank} finished: the ranks no longer agree{RESTART}")
        return None

    def finished_by_a_peer(self, step: int) -> str | None:
        """While this rank waits for the rest of `step`, whose synchronization failed here too (so it
        will drop the step, not finish it): the error if a peer finished that step or gave up on the
        job, when no agreement to drop it can come; else None."""
        if self.store.check([f"{step}/finished"]):
            return (f"step {step}'s synchronization failed on rank {self.rank}, but a peer finished it or "
                    f"stopped: the ranks no longer agree{RESTART}")
        return None
