"""The star (rank 0 connected to every other rank) that carries the ring's checks: its rounds, its
handshake, and what it does with peers that die, stall, report or send malformed frames."""
from __future__ import annotations

import os
import select
import socket
import threading
import time

import numpy as np
import pytest

from sparcoll import transport, wire
from sparcoll.errors import (AuthenticationError, CollectiveTimeout, PeerError, ProtocolError,
                             REPORT_GRACE, SparcollError)
from sparcoll.star import Credentials, Star
from support import on_threads

LIMIT = 4096


def credentials(world: int, secret: bytes = b"s" * 32, job: int = 11) -> Credentials:
    return Credentials(job, wire.JobConfig(world, world, 1, 1, 1), secret)


def connect_all(store, world: int, timeout: float = 10.0, limit: int = LIMIT) -> dict[int, Star]:
    stars = {}

    def rank(r):
        stars[r] = Star.connect(store, r, world, "127.0.0.1", credentials(world), timeout,
                                limit, limit * world)
    on_threads(rank, world, timeout=timeout * 2)
    return stars


def rounds_on_threads(stars: dict[int, Star], body, timeout: float = 20.0) -> dict:
    """body(rank, star) on a thread per rank; {rank: its result or its exception}; every star is
    closed afterwards."""
    results = {}

    def rank(r):
        try:
            results[r] = body(r, stars[r])
        except Exception as exc:
            results[r] = exc
        finally:
            stars[r].close()
    on_threads(rank, len(stars), timeout=timeout)
    return results


def no_report():
    return None


def concatenate(rows):
    return np.concatenate(rows)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_every_rank_gets_rank_0s_verdict_of_every_rows_in_rank_order(store, world):
    """Rows of different lengths on every round; the verdict (here: the rows end to end) reaches
    every rank, and the next round's frames do not mix with the last one's."""
    stars = connect_all(store, world)
    rng = np.random.default_rng(0)
    rows = [[rng.integers(0, 256, size=rng.integers(0, LIMIT), dtype=np.uint8)
             for _ in range(world)] for _ in range(20)]

    def body(r, star):
        return [star.round(rows[i][r], concatenate, time.monotonic() + 10, no_report).copy()
                for i in range(len(rows))]
    results = rounds_on_threads(stars, body)
    for r in range(world):
        assert not isinstance(results[r], Exception), results[r]
        for i, verdict in enumerate(results[r]):
            assert np.array_equal(verdict, np.concatenate(rows[i]))


def test_closed_peers_lists_the_ranks_whose_connection_closed_without_reading_a_frame(store):
    """3 ranks: while every link is open (and rank 1 has a frame waiting at rank 0), rank 0 lists
    none; once rank 2 closes, rank 0 lists rank 2 and rank 1 none (it sees only rank 0); the frame
    is still there for the next round."""
    stars = connect_all(store, 3)
    try:
        stars[1]._send(0, np.arange(5, dtype=np.uint8), time.monotonic() + 5, no_report)
        deadline = time.monotonic() + 5
        while not select.select([stars[0].links[1]], [], [], 0.01)[0] and time.monotonic() < deadline:
            pass
        assert stars[0].closed_peers() == [] and stars[1].closed_peers() == []
        stars[2].close()
        while stars[0].closed_peers() != [2] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stars[0].closed_peers() == [2] and stars[1].closed_peers() == []
        frame = stars[0]._receive(1, LIMIT, time.monotonic() + 5, no_report)
        assert np.array_equal(frame, np.arange(5, dtype=np.uint8))
    finally:
        for star in stars.values():
            star.close()


def test_a_stranger_at_rank_0_is_refused_and_the_ranks_still_connect(store):
    """A client with the wrong secret connects to rank 0's star before the ranks do: it is
    refused (AuthenticationError on its side), and rank 0 goes on to take the real ranks."""
    world = 2
    stranger = {}

    def intrude():
        deadline = time.monotonic() + 10
        while not store.check(["star"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        hello = wire.Hello(11, 1, 0, credentials(world).config, os.urandom(wire.NONCE_BYTES))
        try:
            transport.connect(store.get("star").decode(), hello, b"w" * 32, 5.0,
                              wire.job_token(b"w" * 32), peer="rank 0 at")
        except Exception as exc:
            stranger["error"] = exc

    def rank(r):
        if r == 1:
            intrude()
        stars[r] = Star.connect(store, r, world, "127.0.0.1", credentials(world), 10.0, LIMIT,
                                LIMIT * world)
    stars = {}
    on_threads(rank, world, timeout=30)
    assert isinstance(stranger.get("error"), AuthenticationError), stranger
    results = rounds_on_threads(stars, lambda r, s: s.round(np.full(3, r, np.uint8), concatenate,
                                                            time.monotonic() + 10, no_report))
    assert all(np.array_equal(v, [0, 0, 0, 1, 1, 1]) for v in results.values()), results


def test_another_jobs_rank_is_refused_and_rank_0_times_out_without_its_own(store):
    """Only ranks of this job (its secret, its id) join; rank 0 names the ranks that never came."""
    world = 2
    errors = {}

    def rank(r):
        job = 11 if r == 0 else 12
        try:
            Star.connect(store, r, world, "127.0.0.1", credentials(world, job=job), 4.0,
                         LIMIT, LIMIT * world)      # rank 1's refusal must come within it
        except SparcollError as exc:
            errors[r] = exc
    on_threads(rank, world, timeout=30)
    assert isinstance(errors[0], CollectiveTimeout) and "ranks [1]" in str(errors[0])
    assert isinstance(errors[1], SparcollError) and "not of this job" in str(errors[1])


@pytest.mark.parametrize("who", [0, 1])
def test_a_rank_that_closes_fails_its_peers_at_once_naming_it(store, who):
    world = 3
    stars = connect_all(store, world)

    def body(r, star):
        if r == who:
            star.close()
            return "closed"
        start = time.monotonic()
        try:
            star.round(np.zeros(8, np.uint8), concatenate, time.monotonic() + 30, no_report)
        finally:
            body.elapsed[r] = time.monotonic() - start
    body.elapsed = {}
    results = rounds_on_threads(stars, body)
    for r in range(world):
        if r == who:
            continue
        # rank 0 learns of rank 1 itself; the others learn that rank 0 is gone (it failed)
        assert isinstance(results[r], PeerError), results[r]
        assert f"rank {who if r == 0 else 0}" in str(results[r])
        assert body.elapsed[r] < 5.0     # not the 30 s deadline


@pytest.mark.parametrize("stall", ["sends nothing", "reads nothing"])
def test_a_stalled_peer_ends_the_wait_at_the_deadline_or_at_a_report(store, stall):
    """Rank 1 stalls: it sends nothing (rank 0 waits to receive), or reads nothing while rank 0
    sends a frame larger than the connection's buffers (rank 0 waits for room). Either wait ends at
    the deadline, or at a peer's report, in the kernel's slices."""
    size = 8 if stall == "sends nothing" else 32 << 20
    stars = connect_all(store, 2, limit=max(LIMIT, size))
    report = PeerError("rank 1 refused its input")
    done = threading.Event()

    def body(r, star):
        if r == 1:
            done.wait(10)
            return stall
        start = time.monotonic()
        with pytest.raises(CollectiveTimeout, match="rank 1 did not take part"):
            star.round(np.zeros(size, np.uint8), concatenate, time.monotonic() + 0.3, no_report)
        waited = time.monotonic() - start
        with pytest.raises(PeerError, match="refused its input"):
            star.round(np.zeros(size, np.uint8), concatenate, time.monotonic() + 30,
                       lambda: report if time.monotonic() - start > 0.5 else None)
        done.set()
        return waited, time.monotonic() - start
    results = rounds_on_threads(stars, body)
    waited, total = results[0]
    assert 0.3 <= waited < 2.0 and total < 5.0


@pytest.mark.parametrize("frame", ["too long", "negative", "truncated"])
def test_malformed_frames_are_a_protocol_error_not_a_hang(store, frame):
    """Rank 1 writes raw bytes on its connection instead of a frame: a length over the limit, a
    negative one, or half a frame and then its connection closed."""
    stars = connect_all(store, 2)

    def body(r, star):
        if r == 1:
            sock = star.links[0]
            if frame == "too long":
                sock.sendall(np.array([LIMIT + 1], np.int64).tobytes())
            elif frame == "negative":
                sock.sendall(np.array([-4], np.int64).tobytes() + bytes(4))
            else:
                sock.sendall(np.array([100], np.int64).tobytes() + bytes(10))
                sock.shutdown(socket.SHUT_WR)
            time.sleep(0.5)
            return "sent"
        return star.round(np.zeros(4, np.uint8), concatenate, time.monotonic() + 10, no_report)
    results = rounds_on_threads(stars, body)
    expected = PeerError if frame == "truncated" else ProtocolError
    assert isinstance(results[0], expected), results[0]


@pytest.mark.parametrize("sent", ["in pieces", "two frames at once"])
def test_with_more_than_2_ranks_a_frame_is_read_whole_and_bytes_after_it_are_a_protocol_error(sent):
    """With 3 ranks or more a connection carries one frame at a time each way, so a rank reads what
    is there at once, not the length first: rank 0's end (played here) sends its verdict split
    inside its length and inside its bytes (it is still read whole), or two verdicts at once (a
    peer that did not wait for this rank's next row: a ProtocolError naming the extra bytes)."""
    mine, theirs = socket.socketpair()
    star = Star(1, 3, {0: mine}, row_limit=64, verdict_limit=4096)
    verdict = np.random.default_rng(0).integers(0, 256, size=300, dtype=np.uint8)
    frame = np.int64(len(verdict)).tobytes() + verdict.tobytes()

    def rank_0():
        theirs.recv(4096)                          # rank 1's row
        if sent == "in pieces":
            for piece in (frame[:3], frame[3:100], frame[100:]):
                theirs.sendall(piece)
                time.sleep(0.05)
        else:
            theirs.sendall(frame + frame)
    thread = threading.Thread(target=rank_0, daemon=True)
    thread.start()
    try:
        if sent == "in pieces":
            got = star.round(np.zeros(8, dtype=np.uint8), None, time.monotonic() + 5, no_report)
            assert np.array_equal(got, verdict)
        else:
            thread.join(5)
            with pytest.raises(ProtocolError, match="308 bytes after its frame of 300"):
                star.round(np.zeros(8, dtype=np.uint8), None, time.monotonic() + 5, no_report)
    finally:
        thread.join(5)
        mine.close()
        theirs.close()


def test_two_ranks_rows_larger_than_the_sockets_buffers_cross_without_a_stall(store):
    """With 2 ranks both write their row before reading the other's: a row larger than what the
    two sockets' buffers hold (here 1 MiB against buffers of 64 KiB, as on a kernel whose
    net.core.wmem_max is its default 208 KiB and a row of a gathered float64 call) stalled both
    ranks until the deadline. The rest of a row is now written while the other's is read."""
    size = 1 << 20
    stars = connect_all(store, 2, limit=size)
    for star in stars.values():
        for sock in star.links.values():
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 << 10)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
    rows = [np.random.default_rng(r).integers(0, 256, size=size, dtype=np.uint8) for r in range(2)]

    def body(r, star):
        return [star.round(rows[r], concatenate, time.monotonic() + 5, no_report).copy() for _ in range(3)]
    start = time.monotonic()
    results = rounds_on_threads(stars, body)
    assert time.monotonic() - start < 5
    for r in range(2):
        assert not isinstance(results[r], Exception), results[r]
        assert all(np.array_equal(v, np.concatenate(rows)) for v in results[r])


def test_a_peer_trickling_its_frame_a_byte_at_a_time_ends_the_wait_at_the_deadline():
    """Rank 0's end (played here) sends its verdict one byte per 20 ms: every slice of the wait got a
    byte, so the deadline was looked at only after a slice with nothing (a review measured 4.2 s past
    a deadline of 1 s for 208 bytes; a frame of 1 MiB at a byte per 49 ms took about 14 hours)."""
    mine, theirs = socket.socketpair()
    star = Star(1, 3, {0: mine}, row_limit=64, verdict_limit=4096)
    done = threading.Event()

    def trickle():
        theirs.recv(4096)                          # rank 1's row
        frame = np.int64(200).tobytes() + bytes(200)
        for i in range(len(frame)):
            if done.is_set():
                return
            theirs.send(frame[i:i + 1])
            time.sleep(0.02)
    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    start = time.monotonic()
    try:
        with pytest.raises(CollectiveTimeout, match="did not take part"):
            star.round(np.zeros(8, dtype=np.uint8), None, start + 1.0, lambda: None)
        # (past the deadline, a rank waiting for rank 0 gives it REPORT_GRACE to report whom it waits for)
        assert time.monotonic() - start < 1.5 + REPORT_GRACE
    finally:
        done.set()
        thread.join(5)
        mine.close()
        theirs.close()


def test_idle_connections_at_rank_0_do_not_hold_the_ranks_out(store):
    """Three sockets that connect to rank 0's star and send nothing, before rank 1 does: rank 0 gave
    each its 10 s handshake in turn, and with a start-up deadline of 25 s the job failed to start
    (a review). Handshakes now run side by side: the ranks connect at once."""
    world = 2
    idle = []

    def rank(r):
        if r == 1:
            deadline = time.monotonic() + 10
            while not store.check(["star"]) and time.monotonic() < deadline:
                time.sleep(0.01)
            host, port = transport.parse_address(store.get("star").decode())
            idle.extend(socket.create_connection((host, port), timeout=5) for _ in range(3))
            time.sleep(0.2)         # rank 0 has accepted them
        stars[r] = Star.connect(store, r, world, "127.0.0.1", credentials(world), 25.0, LIMIT, LIMIT * world)
    stars = {}
    start = time.monotonic()
    try:
        on_threads(rank, world, timeout=40)
        assert time.monotonic() - start < 5, time.monotonic() - start
        results = rounds_on_threads(stars, lambda r, s: s.round(np.full(2, r, np.uint8), concatenate,
                                                                time.monotonic() + 10, no_report))
        assert all(np.array_equal(v, [0, 0, 1, 1]) for v in results.values()), results
    finally:
        for sock in idle:
            sock.close()
