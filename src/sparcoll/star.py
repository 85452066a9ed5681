"""Every rank connected straight to rank 0, for the ring's check rounds (ring.py): one frame up, one
frame back (with 2 ranks the two frames cross and each rank decides), written and read by the
calling thread itself.

gloo's collectives pass through its own threads: on this machine its allreduce of one float takes
about 200 us median on 2 ranks on loopback, its allgather of a 1,034-float64 buffer 266 us, and with
4 ranks on 2 cores 421 and 3070 us. A round here (every rank sends rank 0 its frame; rank 0 answers
each with one frame) took 58 us and 236 us (one-off script, 550 rounds of each interleaved). And
frames have their length in front, so ranks whose calls differ send different sizes and still learn
it from the round, where gloo aborts the process on a size mismatch.

A round is one frame each way per rank, so at most two frames are ever in flight on a connection
(with 2 ranks a peer may send its next one before this rank has read the last). Every wait is in slices of POLL seconds,
between which the caller looks for a peer's report (the sparse path's news of this collective), up
to the collective's deadline. The slices are the kernel's (SO_RCVTIMEO, SO_SNDTIMEO on a blocking
socket), not Python's socket timeout, which polls before every send and receive: three system
calls of a tiny call's six on 2 ranks. Connections are authenticated with the job secret (the aggregators'
handshake, transport.py) and set up once, at init.
"""
from __future__ import annotations

import hmac
import logging
import os
import queue
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import transport, wire
from .transport import sendmsg_all
from .errors import REPORT_GRACE, CollectiveTimeout, PeerError, ProtocolError, SparcollError

POLL = 0.05         # seconds between looks for a peer's report while waiting for a frame
HANDSHAKE = 10.0    # seconds rank 0 gives one connection to authenticate: a stranger that
                    # stalls cannot hold up init to its deadline
EXTRA_HANDSHAKES = 16   # handshakes at once at rank 0 beyond one per rank (strangers' among them)
_LENGTH = struct.Struct("=q")   # a frame: its length in bytes, then that many bytes
_HEADER = _LENGTH.size

log = logging.getLogger("sparcoll.star")


@dataclass(frozen=True)
class Credentials:
    """What a rank proves to rank 0 when it connects: the job's identity and secret (bootstrap.py)."""
    job: int
    config: wire.JobConfig
    secret: bytes


class Star:
    """One rank's end of the star: rank 0 holds a connection to every other rank, the others one
    to rank 0. Frames are bytes; `row_limit` and `verdict_limit` bound a rank's frame and rank 0's
    answer: a longer one is malformed."""

    def __init__(self, rank: int, world: int, links: dict[int, socket.socket], row_limit: int,
                 verdict_limit: int):
        self.rank, self.world, self.links = rank, world, links
        self.row_limit, self.verdict_limit = row_limit, verdict_limit
        limit = row_limit if rank == 0 or world == 2 else verdict_limit
        self._inbox = {r: np.zeros(_HEADER + limit, dtype=np.uint8) for r in links}
        self._length = bytearray(_HEADER)       # a frame's header, being sent
        self._length_view = memoryview(self._length)
        for sock in links.values():
            _wait_in_slices(sock)

    @classmethod
    def connect(cls, store, rank: int, world: int, host: str, credentials: Credentials,
                timeout: float, row_limit: int, verdict_limit: int,
                abandon: Callable[[], BaseException | None] = lambda: None) -> "Star":
        """Rank 0 listens at `host` and publishes its address in `store`; every other rank
        connects and authenticates. CollectiveTimeout if not done within `timeout`; `abandon()`'s
        error (a peer that gave up init meanwhile) as soon as it has one, looked at every POLL."""
        deadline = time.monotonic() + timeout
        if rank == 0:
            links = _accept_ranks(store, world, host, credentials, deadline, abandon)
        else:
            wait_in_store(store, ["star"], deadline, POLL, abandon, lambda missing: (
                f"rank {rank}: rank 0 did not publish its address within {timeout:g} s"))
            hello = wire.Hello(credentials.job, rank, 0, credentials.config,
                               os.urandom(wire.NONCE_BYTES))
            links = {0: transport.connect(store.get("star").decode(), hello, credentials.secret,
                                          max(0.01, deadline - time.monotonic()),
                                          wire.job_token(credentials.secret), abandon=abandon,
                                          peer="rank 0 at")}
        return cls(rank, world, links, row_limit, verdict_limit)

    def round(self, row: np.ndarray, decide: Callable[[list[np.ndarray]], np.ndarray],
              deadline: float, peer_report) -> np.ndarray:
        """Every rank's `row` (uint8) to rank 0, where `decide(rows)` (in rank order) makes the
        verdict (uint8) that every rank gets back and returns. The verdict is valid until the
        next round. `peer_report()` returns a peer's error for this collective, if one arrived.
        With 2 ranks the two rows cross and each rank decides itself (`decide` must give both the
        same verdict): one step where rank 0's verdict would make two."""
        if self.world == 2:
            # both write first: what the sockets' buffers do not take within a slice is written
            # while the peer's row is read (a 1 MiB row each way stalled both ranks on a kernel
            # whose socket buffers stop at 208 KiB, net.core.wmem_max's default). Not at once:
            # select's "writable" waits for a third of the buffer to drain, which made 64K-float
            # gathered calls slower in batches (async 939-949 us a call -> 1562-1592)
            other = 1 - self.rank
            unsent = self._write(other, self._framed(row), 0, peer_report)
            theirs = self._receive(other, self.row_limit, deadline, peer_report, unsent)
            return decide([row, theirs] if self.rank == 0 else [theirs, row])
        if self.rank != 0:
            self._send(0, row, deadline, peer_report)
            return self._receive(0, self.verdict_limit, deadline, peer_report)
        rows = [row] + [self._receive(r, self.row_limit, deadline, peer_report)
                        for r in range(1, self.world)]
        verdict = decide(rows)
        for r in range(1, self.world):
            self._send(r, verdict, deadline, peer_report)
        return verdict

    def _framed(self, frame: np.ndarray) -> list[memoryview]:
        """`frame` behind its length, as the views to write."""
        _LENGTH.pack_into(self._length, 0, len(frame))
        return [self._length_view, memoryview(frame)]

    def _write(self, peer: int, views: list, flags: int, peer_report, deadline: float | None = None) -> list:
        """Write `views` to `peer`; what is left unwritten (no room within a slice, at once with
        MSG_DONTWAIT, or once the deadline passed)."""
        try:
            return sendmsg_all(self.links[peer], views, flags, deadline)
        except OSError as exc:
            raise report_soon(peer_report) or PeerError(
                f"rank {self.rank}: lost the connection to rank {peer} ({exc})") from exc

    def _send(self, peer: int, frame: np.ndarray, deadline: float, peer_report) -> None:
        """`frame` behind its length, waiting for room in slices of POLL."""
        views = self._write(peer, self._framed(frame), 0, peer_report, deadline)
        while views:        # no room for a slice (the peer is reading a large frame), or late
            self._still_waiting(peer, deadline, peer_report)
            views = self._write(peer, views, 0, peer_report, deadline)

    def _receive(self, peer: int, limit: int, deadline: float, peer_report,
                 unsent: list = ()) -> np.ndarray:
        """The next frame from `peer`, as a view of its inbox: its length, then exactly that many
        bytes. With 2 ranks the peer's next frame may follow it at once, so the length is read
        first; with more, a connection carries one frame at a time each way (a rank's next row
        waits for the verdict, the next verdict for every row), so one read takes what is there:
        a receive less a frame (rank 0's three of a 4-rank call), and bytes beyond the frame are a
        ProtocolError. `unsent`: the rest of this rank's own frame to `peer`, written as the
        socket takes it meanwhile (the peer, too, writes before it reads)."""
        inbox = self._inbox[peer]
        view = memoryview(inbox)
        sock, got = self.links[peer], 0
        size = _HEADER if self.world == 2 else len(inbox)     # until the length is known
        length = None
        while got < size or unsent:
            if time.monotonic() >= deadline:    # a peer trickling bytes never leaves a slice empty
                self._still_waiting(peer, deadline, peer_report)
            flags = 0
            if unsent:      # wait for room to write or something to read, whichever comes
                readable, writable, _ = select.select([sock] if got < size else [], [sock], [], POLL)
                if writable:
                    unsent = self._write(peer, unsent, socket.MSG_DONTWAIT, peer_report)
                if not readable:
                    if not writable:
                        self._still_waiting(peer, deadline, peer_report)
                    continue
                flags = socket.MSG_DONTWAIT
            try:
                n = sock.recv_into(view[got:size], 0, flags)
            except BlockingIOError:     # a slice ended with nothing to read
                n = None                # (looked at outside: not the context of a report)
            except OSError as exc:
                raise report_soon(peer_report) or PeerError(
                    f"rank {self.rank}: lost the connection to rank {peer} ({exc})") from exc
            if n is None:
                self._still_waiting(peer, deadline, peer_report)
                continue
            if n == 0:
                raise report_soon(peer_report) or PeerError(
                    f"rank {self.rank}: rank {peer} closed its connection (it died, failed or "
                    f"closed its communicator)")
            got += n
            if length is None and got >= _HEADER:
                length = _LENGTH.unpack_from(inbox)[0]
                if not 0 <= length <= limit:
                    raise ProtocolError(f"rank {self.rank}: rank {peer} sent a frame of {length} "
                                        f"bytes (at most {limit})")
                size = _HEADER + length
                if got > size:
                    raise ProtocolError(f"rank {self.rank}: rank {peer} sent {got - size} bytes "
                                        f"after its frame of {length}, where it had to wait for "
                                        f"an answer")
        return inbox[_HEADER:size]

    def _still_waiting(self, peer: int, deadline: float, peer_report) -> None:
        if peer == 0 and self.world > 2 and time.monotonic() >= deadline:
            # Rank 0 waits for every rank's row, and at the same deadline reports the rank it waited
            # for: named here too (every rank but the late one blamed rank 0, a review).
            report = report_soon(peer_report)
            if report is not None:
                raise report
        still_waiting(peer_report, deadline, f"rank {self.rank}: rank {peer} did not take part in "
                      f"the ring's check within the timeout")

    def closed_peers(self) -> list[int]:
        """The ranks whose connection to this rank is closed or reset (they died or left), looked
        at without reading anything: for errors that do not say which rank it was (gloo's)."""
        closed = []
        for peer, sock in self.links.items():
            try:
                if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    closed.append(peer)
            except (BlockingIOError, InterruptedError):     # open, nothing to read
                pass
            except OSError:                                 # reset, or closed here
                closed.append(peer)
        return closed

    def close(self) -> None:
        """Close every connection: a peer waiting for a frame from this rank fails at once."""
        for sock in self.links.values():
            try:
                sock.close()
            except OSError:
                pass
        self.links = {}


def wait_in_store(store, keys: list[str], deadline: float, poll: float,
                  abandon: Callable[[], BaseException | None], timed_out: Callable[[list[str]], str]) -> None:
    """Wait for `keys` in `store` until `deadline`, looking every `poll` seconds at most (sooner at
    first: a peer is usually there within milliseconds) whether they are there and whether
    `abandon()` has an error (a peer that gave up meanwhile: its peers would wait out the whole timeout
    for its keys) that ends the wait; CollectiveTimeout(timed_out(the keys still missing)) at the
    deadline. Looked at, not waited for: every store.wait that timed out printed two warnings of
    torch's, hundreds in a minute's wait for a peer that never came."""
    pause = 0.001
    while not store.check(keys):
        failure = abandon()
        if failure is not None:
            raise failure
        left = deadline - time.monotonic()
        if left <= 0:
            raise CollectiveTimeout(timed_out([key for key in keys if not store.check([key])]))
        time.sleep(min(pause, poll, left))
        pause *= 2


def _wait_in_slices(sock: socket.socket) -> None:
    """Make `sock` blocking with every send and receive ending after POLL seconds without progress
    (BlockingIOError, or a send that returns what it wrote so far)."""
    sock.settimeout(None)
    slice_ = struct.pack("ll", int(POLL), int(POLL % 1 * 1e6))     # struct timeval
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, slice_)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, slice_)


def _accept_ranks(store, world: int, host: str, credentials: Credentials,
                  deadline: float, abandon) -> dict[int, socket.socket]:
    """Rank 0: listen, publish the address, and take one authenticated connection from every
    other rank. A connection that fails the handshake (a stranger, another job) is dropped and
    the wait goes on. Handshakes run side by side, each on a thread of its own for at most
    HANDSHAKE seconds (at most world + EXTRA_HANDSHAKES at once; more are closed at once): one at a
    time, three idle sockets of an outsider held the ranks out for 30 s and the job failed to start."""
    token = wire.job_token(credentials.secret)
    links: dict[int, socket.socket] = {}
    outcomes: queue.SimpleQueue = queue.SimpleQueue()
    gate = threading.Lock()
    taking = True           # outcomes are taken; once not, a handshake that ends closes its socket
    running = 0

    def handshake(sock: socket.socket, seconds: float) -> None:
        try:
            outcome = (sock, transport.accept(sock, lambda _: credentials.secret, admit, seconds), None)
        except BaseException as exc:     # every outcome reaches the loop below, or the socket closes
            outcome = (sock, None, exc)
        with gate:
            if taking:
                outcomes.put(outcome)
                return
        sock.close()

    def take_outcomes() -> None:
        nonlocal running
        while True:
            try:
                sock, hello, exc = outcomes.get_nowait()
            except queue.Empty:
                return
            running -= 1
            if exc is None and hello.rank in links:
                exc = ProtocolError(f"rank {hello.rank} joined twice")
            if exc is not None:
                if not isinstance(exc, (SparcollError, OSError)):
                    log.error("a handshake at rank 0's star failed with an internal error", exc_info=exc)
                log.warning("rank 0 refused a connection to its star: %s", exc)
                sock.close()
            else:
                links[hello.rank] = sock

    def admit(hello: wire.Hello, job_token: bytes) -> None:
        if hello.job != credentials.job or not hmac.compare_digest(job_token, token):
            raise ProtocolError(f"a connection for job {hello.job:#x} is not of this job")
        if hello.config != credentials.config or not 0 < hello.rank < world \
                or hello.rank in links:
            raise ProtocolError(f"rank {hello.rank} of job {hello.job:#x} cannot join "
                                f"(already joined, or its options differ)")

    try:
        with transport.listen(host, 0, backlog=world) as listener:
            store.set("star", transport.format_address(host, listener.getsockname()[1]))
            while True:
                take_outcomes()
                if len(links) == world - 1:
                    return links
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, world)) - set(links))
                    raise CollectiveTimeout(f"rank 0: ranks {missing} did not connect to it within "
                                            f"the timeout")
                listener.settimeout(min(left, POLL))
                try:
                    sock, _ = listener.accept()
                except socket.timeout:
                    failure = abandon()     # a rank that gave up init never connects
                    if failure is not None:
                        raise failure from None
                    continue
                if running >= world + EXTRA_HANDSHAKES:
                    log.warning("rank 0 closed a connection to its star: %d handshakes already run", running)
                    sock.close()
                    continue
                running += 1
                threading.Thread(target=handshake, args=(sock, min(left, HANDSHAKE)), daemon=True,
                                 name="sparcoll-star-handshake").start()
    except BaseException:
        for sock in links.values():
            sock.close()
        raise
    finally:
        with gate:                  # handshakes still running close their own sockets from now on
            taking = False
        while True:                 # those that ended meanwhile: strangers, or a rank twice
            try:
                outcomes.get_nowait()[0].close()
            except queue.Empty:
                break


def still_waiting(peer_report, deadline: float, late: str) -> None:
    """Between two slices of a wait: a peer's report ends it, and so does the deadline
    (CollectiveTimeout saying `late`)."""
    report = peer_report()
    if report is not None:
        raise report
    if time.monotonic() >= deadline:
        raise CollectiveTimeout(f"{late} (a peer may be dead, stuck, or calling other "
                                f"collectives)")


def report_soon(peer_report) -> BaseException | None:
    """A peer's report that arrives within REPORT_GRACE seconds (a peer that refused its input
    reports it, then closes: the closed connection may be seen first)."""
    end = time.monotonic() + REPORT_GRACE
    while (report := peer_report()) is None and time.monotonic() < end:
        time.sleep(0.01)
    return report
