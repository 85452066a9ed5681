"""Floods and slow clients against an aggregator, without the secret: it must keep accepting and serving.

A flood of plain TCP connections that uses up the aggregator's descriptors (accept() fails with EMFILE)
must not stop its accept loop; connections still in their handshake are capped (`max_handshakes`), so
more are closed at once; a handshake has one deadline for the whole exchange, however slowly the peer
trickles it; and no failure of a server thread, expected or not, ends the service. After each attack an
honest two-rank job must reduce exactly on the same aggregator.
"""
from __future__ import annotations

import errno
import logging
import os
import resource
import secrets
import select
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from sparcoll import server as server_module, transport, wire
from sparcoll.communicator import Communicator
from sparcoll.errors import CollectiveTimeout, PeerError, SparcollError
from support import block_sparse, on_threads, start_aggregator, stop, wait_for

SECRET = secrets.token_hex(16)
CFG = wire.JobConfig(world=1, num_aggs=1, streams=1, credits=2, message_blocks=64)
FD_LIMIT = 64               # the flooded aggregator's RLIMIT_NOFILE
JOB_TIMEOUT = 10.0


def hello(job: int, rank: int = 0) -> wire.Hello:
    return wire.Hello(job, rank, 0, CFG, os.urandom(wire.NONCE_BYTES))


def honest_job(address: str, store, prefix: str) -> None:
    """Two ranks on threads reduce block-sparse data through the dedicated aggregator at `address`;
    the result must be the dense sum computed here."""
    rng = torch.Generator().manual_seed(len(prefix))
    xs = [block_sparse(rng, 64, 256, 0.5)[0].view(-1) for _ in range(2)]
    want = xs[0] + xs[1]

    def run(rank):
        with Communicator(dist.PrefixStore(prefix, store), rank, 2, aggregators=[address],
                          timeout=JOB_TIMEOUT) as comm:
            comm.allreduce(xs[rank])
    on_threads(run, 2, timeout=6 * JOB_TIMEOUT)
    assert all(torch.equal(x, want) for x in xs)


def closed_by_peer(sock: socket.socket, limit: float) -> bool:
    """Whether the peer closes `sock` within `limit` seconds (data it sends meanwhile is skipped)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if select.select([sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
            try:
                if sock.recv(4096) == b"":
                    return True
            except ConnectionResetError:
                return True
    return False


def still_open(sock: socket.socket) -> bool:
    return not closed_by_peer(sock, 0.0)


def open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_descriptor_flood_does_not_stop_a_dedicated_aggregator(store, monkeypatch):
    """Plain connections, more than the aggregator's descriptor limit allows, held open: accept()
    fails with EMFILE until they close. The aggregator must then accept again at once."""
    monkeypatch.setenv("SPARCOLL_SECRET", SECRET)
    proc, address = start_aggregator()
    flood: list[socket.socket] = []
    try:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (FD_LIMIT, hard))
        assert open_descriptors(proc.pid) < FD_LIMIT // 2      # the attack has room to use up
        host, port = transport.parse_address(address)
        deadline = time.monotonic() + 30
        while len(flood) < 4 * FD_LIMIT and time.monotonic() < deadline:
            try:
                flood.append(socket.create_connection((host, port), timeout=5))
            except OSError:             # the listen backlog is full: enough
                break
        assert len(flood) > FD_LIMIT
        # Every descriptor it may open is taken: accept() fails with EMFILE from here on.
        assert wait_for(lambda: open_descriptors(proc.pid) >= FD_LIMIT, 10), \
            open_descriptors(proc.pid)
        time.sleep(1.0)                 # several failed accepts (one every ACCEPT_BACKOFF)
        assert proc.poll() is None
        attack_ended = time.monotonic()
        for sock in flood:
            sock.close()
        honest_job(address, store, "after-flood/")
        recovered = time.monotonic() - attack_ended
        print(f"\n{len(flood)} connections against a limit of {FD_LIMIT} descriptors; the honest "
              f"job finished {recovered:.2f} s after the attack ended")
        assert recovered < 6 * JOB_TIMEOUT
        assert proc.poll() is None
    finally:
        for sock in flood:
            sock.close()
        stop(proc)


def test_accept_loop_survives_any_failure_and_ends_only_when_closed(monkeypatch, caplog):
    """Injected accept() failures, OSErrors (out of descriptors, memory, buffers; a connection
    aborted) and anything else: each is counted, one line is logged for them all (rate-limited), and
    the next client is served."""
    injected = [OSError(code, os.strerror(code)) for code in
                (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED)]
    injected.append(RuntimeError("injected"))
    pending = list(injected)
    original = socket.socket.accept

    def accept(self):
        if pending and threading.current_thread().name == "sparcoll-accept":
            raise pending.pop(0)
        return original(self)

    monkeypatch.setattr(socket.socket, "accept", accept)
    caplog.set_level(logging.WARNING, logger="sparcoll.aggregator")
    server = server_module.AggregatorServer("127.0.0.1", 0, SECRET.encode())
    try:
        assert wait_for(lambda: server.accept_failures.count == len(injected), 10)
        sock = transport.connect(server.address, hello(7), SECRET.encode(), 10.0)
        sock.sendall(wire.bye_message(7))
        sock.close()
        lines = [r for r in caplog.records if "accepting a connection failed" in r.getMessage()]
        assert 1 <= len(lines) < len(injected), [r.getMessage() for r in lines]
        assert server._accepter.is_alive()
    finally:
        server.close()
    server._accepter.join(10)
    assert not server._accepter.is_alive()


def test_close_ends_every_thread_of_the_server_before_it_returns():
    """A thread still ending after close() may be stopped by the interpreter's exit inside its
    clean-up, and where that frees a tensor the process aborts: close() waits for them all, a
    worker's connection and a handshake still waiting for its client's first byte included."""
    server = server_module.AggregatorServer("127.0.0.1", 0, SECRET.encode())
    before = set(threading.enumerate())
    attached = transport.connect(server.address, hello(7), SECRET.encode(), 10.0)
    silent = socket.create_connection(server.address.rsplit(":", 1))
    try:
        def connections():
            return [t for t in threading.enumerate() if t not in before and t.name == "sparcoll-agg-recv"]
        assert wait_for(lambda: len(connections()) == 2, 10), [t.name for t in threading.enumerate()]
        threads = [server._accepter, *connections()]
        start = time.monotonic()
        server.close()
        took = time.monotonic() - start
        assert not [t.name for t in threads if t.is_alive()]
        assert took < server_module.CLOSE_JOIN
    finally:
        attached.close()
        silent.close()
        server.close()


def test_handshakes_over_the_cap_are_closed_at_once_and_honest_jobs_still_run(store, monkeypatch,
                                                                              caplog):
    monkeypatch.setattr(server_module, "HANDSHAKE_TIMEOUT", 120.0)   # the held ones stay held
    monkeypatch.setenv("SPARCOLL_SECRET", SECRET)
    caplog.set_level(logging.WARNING, logger="sparcoll.aggregator")
    cap = 4
    server = server_module.AggregatorServer("127.0.0.1", 0, SECRET.encode(), max_handshakes=cap)
    host, port = transport.parse_address(server.address)
    held, extra = [], []
    try:
        # Accepted in order: the first `cap` take every slot, the rest find none.
        held = [socket.create_connection((host, port), timeout=10) for _ in range(cap)]
        extra = [socket.create_connection((host, port), timeout=10) for _ in range(2 * cap)]
        assert all(closed_by_peer(sock, 10) for sock in extra)
        assert all(still_open(sock) for sock in held) and server.handshaking == cap
        assert server.over_cap.count == 2 * cap
        lines = [r for r in caplog.records if "handshakes are in progress" in r.getMessage()]
        assert 1 <= len(lines) < 2 * cap
        for sock in held:
            sock.close()
        assert wait_for(lambda: server.handshaking == 0, 10)
        honest_job(server.address, store, "after-cap/")
    finally:
        for sock in held + extra:
            sock.close()
        server.close()


def trickle(address: str, data: bytes, interval: float, limit: float) -> float | None:
    """Send `data` to `address` one byte every `interval` s until the server closes the connection:
    the seconds from connecting until then (None: still open after `limit` s)."""
    host, port = transport.parse_address(address)
    start = time.monotonic()
    sock = socket.create_connection((host, port), timeout=10)
    try:
        for i in range(int(limit / interval) + 1):
            try:
                sock.sendall(data[i % len(data):i % len(data) + 1])
            except OSError:
                return time.monotonic() - start
            if closed_by_peer(sock, interval):
                return time.monotonic() - start
        return None
    finally:
        sock.close()


def test_trickling_clients_are_cut_off_at_the_handshake_deadline(monkeypatch):
    """One deadline for the whole handshake: a client sending a byte every third of it (each recv
    would be satisfied in time) is cut off at the deadline, not after the 66-byte HELLO."""
    deadline = 1.0
    monkeypatch.setattr(server_module, "HANDSHAKE_TIMEOUT", deadline)
    server = server_module.AggregatorServer("127.0.0.1", 0, SECRET.encode())
    cut: list[float | None] = [None] * 3
    try:
        def client(i):
            cut[i] = trickle(server.address, hello(9, i).encode(), deadline / 3, 10 * deadline)
        on_threads(client, len(cut))
        assert all(t is not None and 0.9 * deadline <= t < 10 * deadline for t in cut), cut
        print(f"\ntrickling clients cut off after {', '.join(f'{t:.2f}' for t in cut)} s "
              f"(deadline {deadline:g} s)")
        assert wait_for(lambda: server.handshaking == 0 and not server.jobs, 10)
    finally:
        server.close()


def test_trickling_server_is_cut_off_at_the_connect_deadline():
    """The client's side of the handshake has one deadline too: a server that answers a byte every
    third of it does not hold connect() past it."""
    timeout = 1.0
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    stop_event = threading.Event()

    def serve():
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            for _ in range(int(10 * timeout / (timeout / 3))):
                if stop_event.wait(timeout / 3):
                    return
                try:
                    conn.sendall(b"S")
                except OSError:
                    return
    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        start = time.monotonic()
        with pytest.raises(CollectiveTimeout, match="timed out"):
            transport.connect("127.0.0.1:%d" % listener.getsockname()[1], hello(3),
                              SECRET.encode(), timeout)
        assert time.monotonic() - start < 10 * timeout
    finally:
        stop_event.set()
        listener.close()
        server.join(10)
    assert not server.is_alive()


def test_internal_error_in_a_handshake_costs_that_connection_only(monkeypatch, caplog):
    """An unexpected exception in a connection's thread (here in its handshake) is logged, that
    connection is closed and its handshake slot freed; the thread ends cleanly and the next client
    is served."""
    thread_errors = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)
    original = transport.accept
    calls = []

    def accept(*args):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("injected bug")
        return original(*args)

    monkeypatch.setattr(transport, "accept", accept)
    caplog.set_level(logging.WARNING, logger="sparcoll.aggregator")
    server = server_module.AggregatorServer("127.0.0.1", 0, SECRET.encode())
    try:
        host, port = transport.parse_address(server.address)
        with socket.create_connection((host, port), timeout=10) as victim:
            assert closed_by_peer(victim, 10)
        assert wait_for(lambda: server.handshaking == 0, 10)
        assert any("internal error" in r.getMessage() and r.exc_info for r in caplog.records)
        sock = transport.connect(server.address, hello(11), SECRET.encode(), 10.0)
        sock.sendall(wire.bye_message(11))
        sock.close()
        assert wait_for(lambda: not server.jobs and not server._connections, 10)
        assert not thread_errors, thread_errors
    finally:
        server.close()


def test_a_flood_of_failed_collectives_logs_a_line_per_interval(caplog):
    """A client holding the secret can fail collectives (an ERROR message each, with up to 64 KiB of
    its own text) as fast as it sends: each was logged, so a server's log grew with the network's
    speed. Every one is still sent to the job's workers; the log gets one line per interval."""
    from sparcoll.aggregator import AggregatorJob, LocalWorker
    job = AggregatorJob(1, 0, wire.JobConfig(2, 1, 1, 2, 4), b"t" * 32)
    told = []
    job.attach(0, LocalWorker(told.append))
    with caplog.at_level(logging.WARNING, logger="sparcoll.aggregator"):
        for collective in range(1, 1001):
            job.fail(collective, wire.ErrorCode.PEER, "x" * 65536)
    lines = [r for r in caplog.records if "failed: x" in r.getMessage()]
    assert len(lines) == 1, len(lines)
    assert len(told) == 1000 and all(len(message.text) == 65536 for message in told)
    # what the job remembers for latecomers is as long as a refusal carries: it kept all 64 KiB of
    # each of the last 64 (4 MiB a job)
    assert sum(len(failed.text) for failed in job._failed.values()) <= 64 * wire.MAX_REASON_BYTES


def test_a_colocated_aggregator_leaves_a_failure_to_the_exception_its_own_rank_raises(caplog):
    """A colocated aggregator's process raises the failure to its caller: its log line came on top of
    the exception on the user's terminal. It is logged at INFO there, at WARNING by a dedicated one."""
    from sparcoll.aggregator import AggregatorJob, LocalWorker
    with caplog.at_level(logging.INFO, logger="sparcoll.aggregator"):
        for colocated in (True, False):
            job = AggregatorJob(1, 0, wire.JobConfig(2, 1, 1, 2, 4), b"t" * 32, colocated=colocated)
            job.attach(0, LocalWorker(lambda message: None))
            job.fail(1, wire.ErrorCode.PEER, f"colocated {colocated}")
    levels = {r.getMessage().rsplit(": ", 1)[1]: r.levelno for r in caplog.records if "colocated" in r.getMessage()}
    assert levels == {"colocated True": logging.INFO, "colocated False": logging.WARNING}, levels


def _authenticated(address: str, job: int, rank: int, world: int = 4096) -> socket.socket:
    """An admitted connection of rank `rank` of a job of `world`, left idle."""
    config = wire.JobConfig(world=world, num_aggs=1, streams=1, credits=2, message_blocks=64)
    hello = wire.Hello(job, rank, 0, config, os.urandom(wire.NONCE_BYTES))
    return transport.connect(address, hello, SECRET.encode(), 10.0)


def test_connections_over_the_cap_are_refused_with_the_reason_until_some_close(store, monkeypatch):
    """At most `max_connections` admitted at once: the next is refused at its handshake, saying
    so; once one closes, a connection is admitted again, and an honest job reduces exactly."""
    monkeypatch.setenv("SPARCOLL_SECRET", SECRET)
    server = server_module.AggregatorServer("127.0.0.1", 0, SECRET.encode(), max_connections=3)
    held = []
    try:
        held = [_authenticated(server.address, 7, rank) for rank in range(3)]
        with pytest.raises(PeerError, match=r"serves 3 connections, its limit \(max_connections\)"):
            _authenticated(server.address, 8, 0)
        assert 8 not in server.jobs
        held.pop().close()
        assert wait_for(lambda: server.admitted == 2, 10), server.admitted
        held.append(_authenticated(server.address, 8, 0))
        for sock in held:
            sock.close()
        assert wait_for(lambda: server.admitted == 0 and not server.jobs, 10), (server.admitted, server.jobs)
        honest_job(server.address, store, "after-connections/")
    finally:
        for sock in held:
            sock.close()
        server.close()


def test_idle_authenticated_connections_cannot_take_the_descriptors_honest_handshakes_need(store,
                                                                                           monkeypatch):
    """A holder of the secret opens idle admitted connections, as many as it can, against an
    aggregator of 160 descriptors. Before, they took every descriptor (accept() then failed
    with EMFILE) and an honest rank's handshake failed without a reason until they closed. Now the
    descriptor limit less the handshakes' and SPARE_DESCRIPTORS caps them: the aggregator keeps
    descriptors free, and an honest rank is refused at once, saying why; after the attack an
    honest job reduces exactly."""
    monkeypatch.setenv("SPARCOLL_SECRET", SECRET)
    limit, handshakes = 160, 16
    proc, address = start_aggregator("--max-handshakes", str(handshakes))
    held = []
    try:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (limit, hard))
        refusal = None
        deadline = time.monotonic() + 60
        while refusal is None and len(held) < limit and time.monotonic() < deadline:
            try:
                held.append(_authenticated(address, 9, len(held)))
            except SparcollError as exc:
                refusal = exc
        cap = limit - handshakes - server_module.SPARE_DESCRIPTORS
        assert len(held) == cap, (len(held), refusal)
        assert isinstance(refusal, PeerError) and "its limit (the descriptor limit 160" in str(refusal), refusal
        assert open_descriptors(proc.pid) < limit - handshakes
        started = time.monotonic()
        with pytest.raises(SparcollError, match="its limit"):
            with Communicator(dist.PrefixStore("during/", store), 0, 1, aggregators=[address],
                              timeout=JOB_TIMEOUT):
                pass
        assert time.monotonic() - started < JOB_TIMEOUT
        for sock in held:
            sock.close()
        held = []
        assert wait_for(lambda: open_descriptors(proc.pid) < 2 * server_module.SPARE_DESCRIPTORS, 10)
        honest_job(address, store, "after-idle/")
        assert proc.poll() is None
    finally:
        for sock in held:
            sock.close()
        stop(proc)
