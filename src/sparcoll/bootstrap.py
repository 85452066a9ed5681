"""Rendezvous through the torch.distributed Store: job identity, aggregator addresses, connections.

Keys under the communicator's Store prefix, then under its generation G (a rank's n-th communicator
on the same prefix has G = n: a re-created communicator never reads the keys of an earlier one):
  generation/<rank>   how many communicators the rank created on this prefix (G)
  G/job               rank 0's random 64-bit job id and 32-byte job secret
  G/aggregator/<rank> host:port of a rank's colocated aggregator
  G/init-failed/<rank>  why a rank gave up init (its aggregator is going away)
  G/init-failures     how many ranks gave up init (one key every waiting rank can poll)
  G/layout            rank 0's aggregators: "colocated", or how many dedicated ones
  G/ready/<stage>/<rank>  the rank got past that stage of init (connected, ring)
  G/ring/star         host:port of rank 0's end of the star (star.py)
  G/ring/data/...     gloo's own keys, for the communicator's ring (ring.py)
"""
from __future__ import annotations

import math
import re
import secrets
import socket
import time
from typing import Callable

import torch.distributed as dist

from . import errors, transport, wire
from .errors import CollectiveTimeout, PeerError, SparcollError
from .hosts import is_loopback
from .ring import Ring
from .star import Credentials, wait_in_store


GAVE_UP = re.compile(r"rank \d+ gave up init: ")
FAILURE_POLL = 0.25     # seconds between looks for a peer that gave up init while waiting for keys


def _at_most_every(seconds: float, check: Callable[[], SparcollError | None]) -> Callable[[], SparcollError | None]:
    """`check`, run at most once in `seconds` (None between): a thousand ranks retrying refused
    connections every 50 ms would ask rank 0's Store 20,000 times a second."""
    last = -math.inf

    def throttled() -> SparcollError | None:
        nonlocal last
        if time.monotonic() - last < seconds:
            return None
        last = time.monotonic()
        return check()
    return throttled


class Rendezvous:
    """One rank's steps of init, each bounded by one deadline."""

    def __init__(self, store, rank: int, world: int, timeout: float):
        self.rank, self.world, self.timeout = rank, world, timeout
        self.own_address: str | None = None     # this rank's colocated aggregator's, once published
        self.deadline = time.monotonic() + timeout
        generation = store.add(f"generation/{rank}", 1)
        self.store = dist.PrefixStore(str(generation), store)    # keys "<G>/..."

    def job(self) -> tuple[int, bytes]:
        """(job id, job secret), chosen by rank 0."""
        if self.rank == 0:
            self.store.set("job", secrets.token_bytes(8 + 32))
        self._wait(["job"])
        blob = self.store.get("job")
        return int.from_bytes(blob[:8], "little"), blob[8:]

    def same_layout(self, aggregators: list[str] | None, block_size: int) -> None:
        """MismatchError unless this rank's aggregators are colocated where rank 0's are, or as many
        dedicated ones (a host without $SPARCOLL_AGGREGATORS would wait for the others' colocated
        aggregators until the timeout; the addresses themselves may differ by host: names, routes),
        and its block size is rank 0's (a host with another $SPARCOLL_BLOCK_SIZE met its first
        MismatchError only at its first large sparse collective; a review)."""
        layout = "colocated" if aggregators is None else f"{len(aggregators)} dedicated"
        if self.rank == 0:
            self.store.set("layout", f"{layout}\n{block_size}")
        self._wait(["layout"])
        first, first_block_size = self.store.get("layout").decode().split("\n")
        if first != layout:
            raise errors.MismatchError(f"rank {self.rank}: its aggregators are {layout}, rank 0's are "
                                       f"{first} (aggregators= or $SPARCOLL_AGGREGATORS must agree)")
        if int(first_block_size) != block_size:
            raise errors.MismatchError(f"rank {self.rank}: its block size is {block_size}, rank 0's "
                                       f"{first_block_size} (block_size= or $SPARCOLL_BLOCK_SIZE must agree)")

    def colocated_addresses(self, own: str) -> list[str]:
        """Publish this rank's aggregator address; every rank's, once all are published."""
        self.own_address = own
        self.store.set(f"aggregator/{self.rank}", own)
        keys = [f"aggregator/{r}" for r in range(self.world)]
        self._wait(keys)
        # one request, not one per rank: rank 0's Store served world^2 of them (a review: 14 s of
        # init at 512 ranks)
        return [address.decode() for address in self.store.multi_get(keys)]

    def connect(self, index: int, address: str, hello: wire.Hello, secret: bytes,
                job_token: bytes, colocated: bool) -> socket.socket:
        """An authenticated connection to aggregator `index`. With colocated aggregators, a rank
        that gave up init is reported with its own reason, not as a refused connection; with
        dedicated ones, any rank that did ends the retries (a stopped aggregator refused them until
        init's timeout, though the rank that had found it stopped had said so). The retries look at
        the Store at most every FAILURE_POLL."""
        abandon = (lambda: self._failure_of(index)) if colocated else self._first_failure
        try:
            return transport.connect(address, hello, secret, self.remaining(), job_token,
                                     abandon=_at_most_every(FAILURE_POLL, abandon),
                                     peer=f"rank {index}'s aggregator" if colocated else "aggregator")
        except (PeerError, CollectiveTimeout) as exc:
            # (a review of docs/cluster.md; not where this rank's own aggregator is on loopback too)
            own = self.own_address
            if isinstance(exc, CollectiveTimeout) and colocated and is_loopback(transport.parse_address(address)[0]) \
                    and not (own and is_loopback(transport.parse_address(own)[0])):
                exc = CollectiveTimeout(f"{exc}; that is a loopback address: if rank {index} runs on another host, "
                                        f"it listens where only its own host reaches it: set $SPARCOLL_HOST or "
                                        f"$GLOO_SOCKET_IFNAME there to its training network's")
            raise abandon() or exc

    def ready(self, stage: str = "connected", lost: Callable[[], BaseException | None] = lambda: None) -> None:
        """No rank goes past `stage` of init before every rank got there: none leaves init (and so
        can close its aggregator, or abort its gloo group) while a peer still connects to it. gloo's
        group is up on one rank while its peer still finishes connecting; closed then, the peer's
        fails with gloo's "Connection closed by peer". `lost()`: the error of a connection of this
        rank's that broke meanwhile (an aggregator stopped), which ends the wait; before, init
        waited out its timeout, then blamed the peers that had not come this far (a review)."""
        self.store.set(f"ready/{stage}/{self.rank}", b"1")

        def abandon() -> SparcollError | None:
            broken = lost()     # read first: a peer that gave up announced why before its aggregator closed
            return self._first_failure() or broken
        self._wait([f"ready/{stage}/{r}" for r in range(self.world)], abandon)

    def ring(self, host: str, credentials: Credentials) -> Ring:
        """The communicator's ring (gloo's group and the star), reached at `host` (peers wait for
        it at most the rest of init's timeout)."""
        try:
            return Ring(dist.PrefixStore("ring", self.store), self.rank, self.world,
                        self.remaining(), host, credentials, abandon=self._first_failure)
        except SparcollError:
            raise
        except Exception as exc:   # gloo raises a plain RuntimeError when a peer never shows up
            raise CollectiveTimeout(f"rank {self.rank}: could not set up gloo's ring with every "
                                    f"peer within {self.timeout:g} s ({exc})") from exc

    def announce_failure(self, exc: BaseException) -> None:
        """Tell the peers why this rank gives up init: its aggregator closes now, and a peer that
        finds it gone should report this reason, not a refused connection or a timeout."""
        try:
            self.store.set(f"init-failed/{self.rank}", f"{type(exc).__name__}\n{exc}")
            self.store.add("init-failures", 1)
        except Exception:   # best effort: the Store itself may be what failed
            pass

    def remaining(self) -> float:
        return max(0.1, self.deadline - time.monotonic())

    def _failure_of(self, index: int) -> SparcollError | None:
        """The error rank `index` announced when it gave up init, if it did."""
        key = f"init-failed/{index}"
        try:
            if not self.store.check([key]):
                return None
            kind, _, text = self.store.get(key).decode("utf-8", "replace").partition("\n")
        except Exception:
            return None
        cls = getattr(errors, kind, None)
        if not (isinstance(cls, type) and issubclass(cls, SparcollError)):
            cls = PeerError
        # a rank that gave up for another's reason passes it on as it is: "rank 2 gave up init: rank 3
        # gave up init: rank 4 gave up init: ..." named the rank that started it last
        return cls(text if GAVE_UP.match(text) else f"rank {index} gave up init: {text}")

    def _first_failure(self) -> SparcollError | None:
        """The reason of a peer that gave up init, if one did (one Store call while none has)."""
        try:
            if self.store.add("init-failures", 0) == 0:
                return None
        except Exception:
            return None
        return next((f for f in map(self._failure_of, range(self.world)) if f is not None), None)

    def _wait(self, keys: list[str], abandon: Callable[[], BaseException | None] | None = None) -> None:
        """Wait for `keys` until the deadline; a peer that gave up init (a rank refused by its
        aggregator, with another secret) ends the wait with its reason; `abandon()`, where given,
        decides instead (returning the error that ends the wait, if any)."""
        wait_in_store(self.store, keys, self.deadline, FAILURE_POLL, abandon or self._first_failure, lambda missing: (
            f"rank {self.rank}: {', '.join(missing)} not in the store within {self.timeout:g} s: the ranks "
            f"they are of did not come this far in init (never called it, or stuck before it)"))
