"""Connection.send: written inline when nothing is queued, the rest by the sender thread. Messages from
several threads must arrive whole and in each thread's order, and every message's lease must come back
exactly once, only after its bytes are written (a buffer scribbled over when its lease comes back must not
reach the peer)."""
import socket
import struct
import threading
import time

import numpy as np
import pytest

from sparcoll import transport
from sparcoll.errors import PeerError
from sparcoll.lease import Lease
from support import wait_for

FRAME = struct.Struct("<IHI")     # payload bytes, thread, seq


def _pair(sndbuf: int) -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sndbuf)
    return a, b


def _read_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return bytes(out)


def test_messages_from_threads_arrive_whole_in_order_and_released_after_writing():
    threads, per_thread = 4, 60
    a, b = _pair(64 * 1024)          # small buffers: most messages are partly written inline
    failures, released = [], []
    conn = transport.Connection(a, "test peer", failures.append)
    received: list[tuple[int, int, bytes]] = []
    reader_go = threading.Event()

    def reader():
        reader_go.wait(10)           # let the writers fill the socket buffer first
        b.settimeout(30)
        for _ in range(threads * per_thread):
            size, thread, seq = FRAME.unpack(_read_exact(b, FRAME.size))
            received.append((thread, seq, _read_exact(b, size)))

    def payload(thread: int, seq: int) -> np.ndarray:
        size = int(np.random.default_rng(thread * 1000 + seq).integers(1, 300_000))
        return np.full(size, (thread * 31 + seq) % 251, dtype=np.uint8)

    def writer(thread: int):
        for seq in range(per_thread):
            data = payload(thread, seq)
            header = np.frombuffer(FRAME.pack(data.size, thread, seq), dtype=np.uint8).copy()

            def scribble(data=data, header=header):
                released.append(1)
                data.fill(255)        # the peer must never see this
                header.fill(255)
            conn.send([header, data], lease=Lease(scribble))
    read = threading.Thread(target=reader, daemon=True)
    read.start()
    writers = [threading.Thread(target=writer, args=(t,), daemon=True) for t in range(threads)]
    for w in writers:
        w.start()
    reader_go.set()
    for w in writers:
        w.join(30)
    read.join(30)
    try:
        assert not read.is_alive() and not any(w.is_alive() for w in writers)
        assert len(received) == threads * per_thread and not failures
        for thread in range(threads):
            seqs = [seq for t, seq, _ in received if t == thread]
            assert seqs == list(range(per_thread)), thread
        for thread, seq, data in received:
            assert data == payload(thread, seq).tobytes(), (thread, seq)
        # the sender thread releases a message after its last byte left, which may be just after
        # the reader took that byte
        assert wait_for(lambda: len(released) == threads * per_thread), len(released)
        assert conn.stats.messages_sent == threads * per_thread
    finally:
        conn.close()
        b.close()


def test_broken_peer_fails_the_connection_and_releases_every_message():
    a, b = _pair(64 * 1024)
    failures, released = [], []
    conn = transport.Connection(a, "test peer", failures.append)
    try:
        b.close()
        for _ in range(20):
            conn.send([np.zeros(200_000, dtype=np.uint8)], lease=Lease(lambda: released.append(1)))
        assert wait_for(lambda: failures and len(released) == 20, 10), (failures, len(released))
        assert isinstance(failures[0], PeerError) and "test peer" in str(failures[0])
        conn.send([np.zeros(10, dtype=np.uint8)], lease=Lease(lambda: released.append(1)))
        assert len(released) == 21      # a stopped connection releases at once
    finally:
        conn.close()


@pytest.mark.parametrize("flags", [0, socket.MSG_DONTWAIT])
def test_sendmsg_all_returns_what_is_left(flags):
    a, b = _pair(64 * 1024)
    try:
        a.setblocking(flags == 0)
        views = [memoryview(bytes(100_000)), memoryview(bytes(100_000))]
        if flags:
            left = transport.sendmsg_all(a, list(views), flags)
            assert 0 < sum(len(v) for v in left) < 200_000   # the buffer took part of it
        else:
            reader = threading.Thread(target=lambda: _read_exact(b, 200_000), daemon=True)
            reader.start()
            assert transport.sendmsg_all(a, list(views)) == []
            reader.join(10)
            assert not reader.is_alive()
    finally:
        a.close()
        b.close()


def test_unexpected_error_in_the_sender_fails_the_connection_and_releases_every_message(monkeypatch):
    """Not only OSError: anything raised while writing fails the connection like a broken socket
    (reported, the peer sees it closed), every queued lease goes back and the sender thread ends."""
    a, b = _pair(64 * 1024)
    failures, released = [], []

    def broken(sock, views, flags=0):
        raise ValueError("injected bug")

    monkeypatch.setattr(transport, "sendmsg_all", broken)
    conn = transport.Connection(a, "test peer", failures.append)
    try:
        for _ in range(5):
            conn.send([np.zeros(1000, dtype=np.uint8)], lease=Lease(lambda: released.append(1)))
        assert wait_for(lambda: failures and len(released) == 5, 10), (failures, len(released))
        assert len(failures) == 1 and isinstance(failures[0], PeerError), failures
        assert "test peer" in str(failures[0]) and "ValueError: injected bug" in str(failures[0])
        conn._sender.join(10)
        assert not conn._sender.is_alive()
        b.settimeout(10)
        assert b.recv(1) == b""                  # the peer sees the connection closed
    finally:
        conn.close()
        b.close()


def test_closing_connections_whose_peers_do_not_read_takes_one_timeout_in_all():
    """Peers alive but not reading (stopped, hung) leave each sender blocked in a write: closing them
    one after another cost SENDER_JOIN_S each (5 s times the ranks). close_all waits one timeout for
    all, then shuts the sockets, which ends the blocked writes; every queued message goes back."""
    pairs = [_pair(64 * 1024) for _ in range(4)]
    released, failures = [], []
    conns = [transport.Connection(a, f"peer {i}", failures.append) for i, (a, _) in enumerate(pairs)]
    try:
        for conn in conns:
            for _ in range(3):
                conn.send([np.zeros(400_000, dtype=np.uint8)], lease=Lease(lambda: released.append(1)))
        # the senders are blocked: all 3 messages still out (the last two whole, some of the first)
        assert wait_for(lambda: all(c.unsent > 2 * 400_000 for c in conns), 10)
        start = time.monotonic()
        transport.close_all(conns, timeout=1.0)
        took = time.monotonic() - start
        assert 1.0 <= took < 3.0, took          # one timeout, not one per connection (4 s and more)
        for conn in conns:
            conn._sender.join(10)
            assert not conn._sender.is_alive()
        assert len(released) == 12
        assert failures == []                   # closing on purpose: nothing reported
    finally:
        for conn in conns:
            conn.close()
        for _, b in pairs:
            b.close()


@pytest.mark.parametrize("closed", ["before", "during"])
def test_a_read_against_a_deadline_on_a_connection_closed_here_is_a_peer_error(closed):
    """The aggregator reads a message's body against a deadline (server.BODY_DEADLINE); where its own
    side closes the socket (the server's close, a destroyed group) the read must end as a lost
    connection, which the server handles quietly, never as another error it logs as internal (a
    review saw ValueError "file descriptor cannot be a negative integer" in destroy_process_group),
    and before the deadline."""
    a, b = _pair(64 * 1024)
    conn = transport.Connection(a, "test peer", lambda exc: None)
    try:
        if closed == "before":
            a.close()
        else:
            threading.Timer(0.2, lambda: a.shutdown(socket.SHUT_RDWR)).start()
        start = time.monotonic()
        with pytest.raises(PeerError):
            conn.recv_into(memoryview(bytearray(1024)), deadline=time.monotonic() + 10)
        assert time.monotonic() - start < 5
    finally:
        conn.close()
        b.close()


def test_a_process_out_of_descriptors_fails_its_connect_at_once_saying_what_to_do(monkeypatch):
    """EMFILE does not pass by retrying: init retried it until its timeout (a review: 120 s, at 16
    colocated ranks under `ulimit -n 400`, then "could not connect ... Too many open files")."""
    import errno

    from sparcoll import wire
    from sparcoll.errors import SparcollError

    def out_of_descriptors(*args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")
    monkeypatch.setattr(transport.socket, "create_connection", out_of_descriptors)
    hello = wire.Hello(1, 0, 0, wire.JobConfig(2, 2, 1, 2, 4), bytes(wire.NONCE_BYTES))
    start = time.monotonic()
    with pytest.raises(SparcollError, match=r"Too many open files: this process may open \d+ descriptors "
                                            r"\(ulimit -n\); .* raise the limit, or use dedicated aggregators"):
        transport.connect("127.0.0.1:9", hello, b"", 30.0)
    assert time.monotonic() - start < 5


def test_only_a_busy_refusal_is_tried_again():
    """A server that reads the HELLO and closes without a word (not an aggregator, or one of another
    version) fails the connect at once: retried, it cost init's whole timeout and was blamed on a
    handshake limit (a review). An aggregator over its handshake limit says "busy", and only that is
    tried again (test_faults.py::test_a_job_of_more_ranks_than_the_aggregators_handshake_limit_starts)."""
    from sparcoll import wire
    listener = socket.create_server(("127.0.0.1", 0))
    address = "127.0.0.1:%d" % listener.getsockname()[1]

    def serve_once():
        conn, _ = listener.accept()
        with conn:
            conn.recv(wire.HELLO_BYTES)
    server = threading.Thread(target=serve_once, daemon=True)
    server.start()
    hello = wire.Hello(1, 0, 0, wire.JobConfig(2, 2, 1, 2, 4), bytes(wire.NONCE_BYTES))
    start = time.monotonic()
    try:
        with pytest.raises(PeerError, match="closed the connection"):
            transport.connect(address, hello, b"", 30.0)
        assert time.monotonic() - start < 5
    finally:
        server.join(10)
        listener.close()
