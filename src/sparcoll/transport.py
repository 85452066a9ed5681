"""TCP connections: authenticated handshake, framed sends (inline or by a sender thread), exact receives.

A message is written at once by the thread that sends it when nothing is queued before it and the
socket's buffer takes it without waiting (the common case: it saves a thread hand-off per message);
whatever does not fit goes to the connection's sender thread, so no thread ever blocks in a send (two
hosts whose TCP buffers are both full would otherwise deadlock). Receives are done by the owner's
receiver thread straight into memory it chooses (often the user's tensor).
"""
from __future__ import annotations

import dataclasses
import errno
import hmac
import logging
import os
import queue
import random
import resource
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

from . import wire
from .errors import (AuthenticationError, CollectiveTimeout, MismatchError, PeerError,
                     ProtocolError, SparcollError)
from .lease import Lease, give_back
from .secret import ENV as SECRET_ENV

SENDER_JOIN_S = 5.0      # close() waits this long for the sender to write what was queued
RECV_SLICE = 256 * 1024   # recv_into in slices: measured faster than one huge recv_into here
IOV_MAX = 512

log = logging.getLogger("sparcoll.transport")


@dataclass
class TrafficStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    blocks_sent: int = 0
    blocks_received: int = 0

    def add(self, other: "TrafficStats") -> None:
        for name in other.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


def parse_address(text: str) -> tuple[str, int]:
    """(host, port) of "host:port" or "[IPv6 address]:port", the port in 1-65535 (the kernel would
    take 72836 for 7300)."""
    host, sep, port = text.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or "[" in host or "]" in host:
        raise ValueError(f"aggregator address {text!r} is not host:port ([address]:port for IPv6)")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"aggregator address {text!r}: port {int(port)} is not in 1-65535")
    return host, int(port)


def format_address(host: str, port: int) -> str:
    """"host:port", an IPv6 address in brackets (parse_address reads both back)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen(host: str, port: int, backlog: int) -> socket.socket:
    """A listening socket at (host, port) in the family of the address `host` names (an IPv6
    address or a name that resolves only to one needs AF_INET6; socket.create_server assumes
    AF_INET). OSError where the name does not resolve or the address is not this host's."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return socket.create_server(address, family=family, backlog=backlog)


def _byte_views(buffers: list) -> list:
    """Flat byte views of a message's non-empty buffers."""
    views = [memoryview(b).cast("B") for b in buffers]
    return [v for v in views if len(v)]


def sendmsg_all(sock: socket.socket, views: list, flags: int = 0, deadline: float | None = None) -> list:
    """Write `views` in order; returns what is left unwritten, which is nothing unless the socket's
    buffer filled up with `flags` holding MSG_DONTWAIT, or for longer than its SO_SNDTIMEO, or the
    `deadline` (monotonic) passed: a peer that reads a byte at a time keeps every write making
    progress, and would otherwise hold the loop for as long as the frame takes."""
    left = sum(map(len, views))
    while views:
        if deadline is not None and time.monotonic() >= deadline:
            return views
        try:
            sent = sock.sendmsg(views[:IOV_MAX], (), flags)
        except BlockingIOError:
            return views
        if sent == left:        # all of it: the usual case
            return []
        left -= sent
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0] = views[0][sent:]
                sent = 0
    return views


def _recv_exact(sock: socket.socket, view: memoryview, peer: str,
                deadline: float | None = None) -> None:
    """Fill `view` from `sock`. With a `deadline` (a handshake), every recv waits only for what is
    left of it: a peer trickling a byte at a time cannot stretch the whole read past it."""
    if _recv_until_closed(sock, view, deadline) < len(view):
        raise PeerError(f"{peer} closed the connection")


def _recv_until_closed(sock: socket.socket, view: memoryview, deadline: float | None = None,
                       ready: Callable[[int], None] | None = None) -> int:
    """Fill `view` from `sock` (within `deadline`, as _recv_exact), or stop where the peer closes: how
    many bytes came. `ready(got)`, where given, waits for the next bytes instead of the socket's
    timeout (and raises when they do not come in time)."""
    got, size = 0, len(view)
    while got < size:
        if ready is not None:
            ready(got)
        elif deadline is not None:
            sock.settimeout(_left(deadline))
        n = sock.recv_into(view[got:got + RECV_SLICE])
        if n == 0:
            break
        got += n
    return got


def _recv_within(sock: socket.socket, view: memoryview, peer: str, deadline: float) -> None:
    """Fill `view` from `sock` by `deadline`, waiting for each slice with poll: the socket's own timeout
    would bound its sender thread's writes too (poll, not select: an aggregator's descriptors may
    number in the thousands)."""
    poller = select.poll()
    try:
        poller.register(sock, select.POLLIN)
    except ValueError:      # closed meanwhile (the server closing, a group destroyed): as recv_into's OSError
        raise PeerError(f"{peer}'s connection was closed") from None

    def ready(got: int) -> None:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise PeerError(f"{peer} sent {got} of a message's {len(view)} bytes, and no more in time")
    if _recv_until_closed(sock, view, ready=ready) < len(view):
        raise PeerError(f"{peer} closed the connection")


def _longer_refusal(sock: socket.socket, head: bytes, deadline: float) -> bytes:
    """A refusal of the HELLO whose reason is longer than the challenge it was read as: the rest of
    the reason its header announces, if it comes within a second and the connection then closes
    (an authentic challenge that failed its MAC reads as such a header once in thousands: the server
    then sends nothing more)."""
    announced = wire.refusal_bytes(head)
    if announced is None or announced <= len(head):
        return head
    rest = bytearray(announced - len(head))
    try:
        if _recv_until_closed(sock, memoryview(rest), min(deadline, time.monotonic() + 1.0)) < len(rest):
            return head
    except (socket.timeout, OSError):
        return head
    return head + bytes(rest)


def _raise_refusal(data: bytes, peer: str) -> None:
    """If `data` is a whole refusal verdict, the error it names, with its reason (Busy for one the
    client may try again)."""
    refusal = wire.decode_refusal(data)
    if refusal is not None:
        code, reason = refusal
        if reason.startswith(BUSY):
            raise Busy(reason)
        raise wire.Failure(0, code, f"{peer} refused the connection: {reason}").exception()


def _send_before(sock: socket.socket, data: bytes, deadline: float) -> None:
    """sendall, in what is left of a handshake's `deadline`."""
    sock.settimeout(_left(deadline))
    sock.sendall(data)


def _left(deadline: float) -> float:
    """Seconds until `deadline`; socket.timeout once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("deadline passed")
    return left


class Backlog:
    """Connections whose queued unsent bytes exceed `limit`, counted together: an aggregator's
    connections of one job, since a result queued for one rank comes of every rank's contributions.
    Each connection marks itself as it crosses the limit; a reader waits until none is over."""

    def __init__(self, limit: int):
        self.limit = limit
        self._over: dict[str, "Connection"] = {}    # by peer
        self._cond = threading.Condition()

    @property
    def over(self) -> bool:
        return bool(self._over)

    def mark(self, conn: "Connection", over: bool) -> None:
        with self._cond:
            if over:
                self._over[conn.peer] = conn
            else:
                self._over.pop(conn.peer, None)
                self._cond.notify_all()

    def wait(self, timeout: float) -> list["Connection"]:
        """Wait until no connection is over the limit; those still over it after `timeout` seconds
        (none: the wait ended in time)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._over, timeout)
            return [conn for _, conn in sorted(self._over.items())]


class Connection:
    """One authenticated TCP connection. `send` writes what the socket takes at once and queues the
    rest for a sender thread; `recv_*` block."""

    def __init__(self, sock: socket.socket, peer: str, on_failure: Callable[[Exception], None],
                 backlog: Backlog | None = None):
        self.sock = sock
        self.peer = peer
        self._backlog = backlog      # told when the unsent bytes cross its limit, either way
        self._over = False
        self._stats = TrafficStats()
        self._stats_lock = threading.Lock()
        self._on_failure = on_failure
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._queue_lock = threading.Lock()
        self._unsent = 0            # bytes queued or being written by the sender thread (never an
                                    # empty message: _byte_views drops empty buffers)
        self._stopped = False       # the sender is gone: leases go back at once
        self._header = bytearray(wire.HEADER_BYTES)
        self._closed = False        # no more sends: the sender ends after what is queued
        self._shut = False          # closed by close(): socket shut
        self._sender = threading.Thread(target=self._send_loop, name=f"sparcoll-send-{peer}",
                                        daemon=True)
        self._sender.start()

    def send(self, buffers: list, blocks: int = 0, lease: Lease | None = None) -> None:
        """Send one message (a list of buffers sent back to back); never blocks on the network.
        Written here if nothing is queued before it, as far as the socket takes it without waiting;
        the rest is queued for the sender thread. `lease` (on the buffers' memory) goes back once
        they are no longer needed: written, or dropped because the connection failed."""
        with self._queue_lock:
            if self._stopped:
                views = []
            else:
                views = self._counted_views(buffers, blocks)
                if self._unsent == 0 and not self._closed:
                    try:   # under the lock, so nothing queued meanwhile can overtake the rest
                        views = sendmsg_all(self.sock, views, socket.MSG_DONTWAIT)
                    except Exception:
                        pass    # the sender thread meets the error again and reports it
                if views:
                    nbytes = sum(len(v) for v in views)
                    self._unsent += nbytes
                    self._check_over()
                    self._queue.put((views, lease, nbytes))
                    return
        give_back(lease)

    def _counted_views(self, buffers: list, blocks: int) -> list:
        """The message's byte views, counted before any write: once a peer holds these bytes (and
        may answer, completing a collective) the counters already include them."""
        views = _byte_views(buffers)
        self.count(bytes_sent=sum(len(v) for v in views), messages_sent=1, blocks_sent=blocks)
        return views

    def _send_loop(self) -> None:
        """Write queued messages until close(). Any exception (a broken socket, or anything
        unexpected) fails the connection, and what is still queued is given back."""
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    return
                views, lease, nbytes = item
                try:
                    sendmsg_all(self.sock, views)
                finally:
                    with self._queue_lock:
                        self._unsent -= nbytes
                        self._check_over()
                    give_back(lease)
        except BaseException as exc:    # any (a lease's callback may raise anything): peers must hear of it
            self._fail(exc)
        finally:
            self._stop()

    def _fail(self, exc: Exception) -> None:
        """A send failed: report it (unless closing) and shut the socket down, so that this end's
        receiver and the peer see a broken connection at once rather than at a deadline."""
        cause = str(exc)
        if not isinstance(exc, OSError):
            log.error("sending to %s failed with an internal error", self.peer, exc_info=exc)
            cause = f"internal error ({type(exc).__name__}: {exc})"
        if self._closed:
            return
        try:
            self._on_failure(PeerError(f"sending to {self.peer} failed: {cause}"))
        except Exception:
            log.exception("reporting the failed connection to %s failed", self.peer)
        self.cut()

    def _stop(self) -> None:
        """No more sends: release what is still queued."""
        with self._queue_lock:
            self._stopped = True
            self._unsent = 0        # what is still queued is dropped below
            self._check_over()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                try:
                    give_back(item[1])
                except Exception:     # an owner's callback: the other leases must still go back
                    log.exception("giving back a lease of %s failed", self.peer)

    def _check_over(self) -> None:
        """Tell the backlog when the unsent bytes rise above its limit, and when they are down to
        half of it: readers resume with room for a batch of messages, not one at a time (called
        under the queue's lock)."""
        gate = self._backlog
        if gate is not None and (self._unsent <= gate.limit // 2 if self._over else
                                 self._unsent > gate.limit):
            self._over = not self._over
            gate.mark(self, self._over)

    @property
    def unsent(self) -> int:
        """Bytes queued for the sender thread and not yet written."""
        return self._unsent

    def count(self, **deltas: int) -> None:
        """Add to the traffic counters (one lock, so a snapshot is never half-updated)."""
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    @property
    def stats(self) -> TrafficStats:
        """A consistent copy of this connection's counters."""
        with self._stats_lock:
            return dataclasses.replace(self._stats)

    def recv_header(self, max_blocks: int, job: int) -> wire.Header:
        view = memoryview(self._header)
        _recv_exact(self.sock, view, self.peer)
        self.count(bytes_received=wire.HEADER_BYTES, messages_received=1)
        return wire.decode_header(self._header, max_blocks, job)

    def recv_into(self, view: memoryview, deadline: float | None = None) -> None:
        """Fill `view`; with a `deadline` (monotonic), PeerError if it is not filled by then."""
        if deadline is None:
            _recv_exact(self.sock, view, self.peer)
        else:
            _recv_within(self.sock, view, self.peer, deadline)
        self.count(bytes_received=len(view))

    def cut(self) -> None:
        """Shut the socket down, from any thread: a write or a read blocked on it ends at once (the
        owner's close() still closes it)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def stop_sending(self) -> None:
        """Let the sender end once what is queued is written; later sends are dropped."""
        with self._queue_lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)

    def close(self, deadline: float | None = None) -> None:
        """Stop the sender after what is queued, waiting for it until `deadline` (monotonic; else
        SENDER_JOIN_S from now): then shut the socket, which ends a send that a peer not reading
        blocks, and wakes a receiver blocked on this socket."""
        with self._queue_lock:
            if self._shut:
                return
            self._shut = True
        self.stop_sending()
        deadline = time.monotonic() + SENDER_JOIN_S if deadline is None else deadline
        self._sender.join(timeout=max(0.0, deadline - time.monotonic()))
        self.cut()
        self.sock.close()


def close_all(connections, timeout: float = SENDER_JOIN_S) -> None:
    """Close `connections` within one `timeout`: every sender is told to stop first, so peers that
    do not read cost `timeout` in all, not each."""
    connections = list(connections)
    for conn in connections:
        conn.stop_sending()
    deadline = time.monotonic() + timeout
    for conn in connections:
        conn.close(deadline)


KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 60, 10, 6
USER_TIMEOUT_MS = (KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES) * 1000


def _configure(sock: socket.socket) -> None:
    """No Nagle delay, large buffers, and TCP keepalive: a peer whose host lost power or fell behind a
    partition sends no FIN, and a receive of a long-lived dedicated aggregator waits without a
    deadline (its job's state held); keepalive ends such a connection after about two minutes. The
    kernel sends no keepalive probe while data is unacknowledged or queued (results to a vanished
    worker, or to one that stopped reading): TCP_USER_TIMEOUT ends those after as long, where
    retransmissions alone took about 15 minutes and a zero window held the connection for good."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                       ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        if hasattr(socket, opt):        # Linux; elsewhere the system's keepalive times
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)


BUSY = "busy: "     # how a refusal the client may try again begins (an aggregator over its handshake limit)


class Busy(Exception):
    """The aggregator refused the connection for now: it has as many handshakes in progress as its
    limit (server.MAX_HANDSHAKES)."""


def connect(address: str, hello: wire.Hello, secret: bytes, timeout: float,
            job_token: bytes = bytes(wire.MAC_BYTES),
            abandon: Callable[[], BaseException | None] | None = None,
            peer: str = "aggregator") -> socket.socket:
    """Connect and authenticate both ways (and show the job token); retries refused connections, and
    connections an aggregator over its handshake limit refused as busy, until the deadline, or
    until `abandon()` returns an error to raise instead. The latter after a pause with jitter that
    doubles, up to 0.5 s: a job's ranks that connect all at once then come back spread out (a job of
    more ranks than the limit failed its init). `peer` names the other end in errors."""
    host, port = parse_address(address)
    deadline = time.monotonic() + timeout
    pause = 0.05        # after a busy refusal
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.05, deadline - time.monotonic()))
        except (ConnectionRefusedError, socket.timeout, OSError) as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):   # no retry frees them: they retried until the timeout
                raise SparcollError(f"could not connect to {peer} {address}: {exc}: this process may open "
                                    f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]} descriptors (ulimit -n); a rank "
                                    f"holds about 3 per rank of the job with colocated aggregators, 1 with "
                                    f"dedicated ones: raise the limit, or use dedicated aggregators") from None
            if time.monotonic() >= deadline:
                raise CollectiveTimeout(f"could not connect to {peer} {address} within "
                                        f"{timeout:g} s: {exc}") from None
            wait = 0.05
        else:
            try:
                return _handshake(sock, hello, secret, job_token, f"{peer} {address}",
                                  max(deadline, time.monotonic() + 0.05))
            except Busy as exc:
                if time.monotonic() + pause >= deadline:
                    raise PeerError(f"{peer} {address} refused the connection at every try for {timeout:g} s: "
                                    f"{exc}") from None
            wait, pause = pause * random.uniform(0.5, 1.5), min(2 * pause, 0.5)
        reason = abandon() if abandon is not None else None
        if reason is not None:
            raise reason from None
        time.sleep(wait)


def _handshake(sock: socket.socket, hello: wire.Hello, secret: bytes, job_token: bytes, peer: str,
               handshake_deadline: float) -> socket.socket:
    """The client's side of the handshake on `sock`, closed if it fails; Busy if the server refused
    it for now."""
    try:
        _configure(sock)
        _send_before(sock, hello.encode(), handshake_deadline)
        buf = bytearray(wire.CHALLENGE_BYTES)
        got = _recv_until_closed(sock, memoryview(buf), handshake_deadline)
        if got < len(buf):              # closed early: a refusal of the HELLO, or nothing
            _raise_refusal(bytes(buf[:got]), peer)
            raise PeerError(f"{peer} closed the connection")
        server_nonce, server_mac = wire.decode_challenge(buf)
        if not hmac.compare_digest(server_mac, wire.mac(secret, b"server", hello, server_nonce)):
            _raise_refusal(_longer_refusal(sock, bytes(buf), handshake_deadline), peer)
            raise AuthenticationError(f"{peer} failed authentication (" + (
                "wrong secret?)" if secret else f"this rank has no secret: set ${SECRET_ENV} to the "
                f"aggregator's)"))
        _send_before(sock, wire.encode_proof(wire.mac(secret, b"client", hello, server_nonce),
                                             job_token), handshake_deadline)
        buf = bytearray(wire.VERDICT_BYTES)
        _recv_exact(sock, memoryview(buf), peer, handshake_deadline)
        code, length = wire.decode_verdict(buf)
        if length:
            reason = bytearray(length)
            _recv_exact(sock, memoryview(reason), peer, handshake_deadline)
            raise wire.Failure(0, code, f"{peer} refused the connection: "
                                        f"{reason.decode('utf-8', 'replace')}").exception()
        sock.settimeout(None)
        return sock
    except socket.timeout:
        sock.close()
        raise CollectiveTimeout(f"handshake with {peer} timed out") from None
    except OSError as exc:
        # A reset during the handshake (the aggregator died, or closed with our bytes unread) is a
        # peer failure like any other: callers are promised SparcollError, never a bare OSError.
        sock.close()
        raise PeerError(f"handshake with {peer} failed: {exc}") from exc
    except BaseException:
        sock.close()
        raise


def accept(sock: socket.socket, secret_for: Callable[[wire.Hello], bytes],
           admit: Callable[[wire.Hello, bytes], None], timeout: float) -> wire.Hello:
    """Server side of the handshake. `secret_for(hello)` gives the secret to check the client against;
    `admit(hello, job_token)` runs only once the client proved it holds that secret and may refuse it
    by raising ProtocolError (the client raises AuthenticationError), MismatchError (the client's
    job options disagree: it raises MismatchError) or PeerError (its job ended: it raises
    PeerError); the text is sent back. Nothing the client sends later is read before
    this returns."""
    peer = "client"
    deadline = time.monotonic() + timeout
    try:
        peer = "client %s:%d" % sock.getpeername()[:2]
        _configure(sock)
        buf = bytearray(wire.HELLO_BYTES)
        _recv_exact(sock, memoryview(buf), peer, deadline)
        hello = wire.Hello.decode(buf)
        secret = secret_for(hello)
        server_nonce = os.urandom(wire.NONCE_BYTES)
        _send_before(sock, wire.encode_challenge(server_nonce, wire.mac(secret, b"server", hello,
                                                                        server_nonce)), deadline)
        buf = bytearray(wire.PROOF_BYTES)
        try:
            _recv_exact(sock, memoryview(buf), peer, deadline)
        except PeerError as exc:    # the client checks this server's proof first, and leaves if it fails
            raise AuthenticationError(f"{peer} of job {hello.job:#x} left after this server's proof of the "
                                      f"secret: its secret differs (or it has none), or it gave up ({exc})") from None
        client_mac, job_token = wire.decode_proof(buf)
        if not hmac.compare_digest(client_mac, wire.mac(secret, b"client", hello, server_nonce)):
            _send_before(sock, wire.encode_verdict("authentication failed"), deadline)
            raise AuthenticationError(f"{peer} failed authentication for job {hello.job:#x}")
        admit(hello, job_token)
        _send_before(sock, wire.encode_verdict(), deadline)
        sock.settimeout(None)
        return hello
    except socket.timeout:
        raise CollectiveTimeout(f"handshake with {peer} timed out") from None
    except (ProtocolError, MismatchError, PeerError) as exc:
        code = wire.ErrorCode.AUTHENTICATION if isinstance(exc, ProtocolError) else wire.code_of(exc)
        try:
            _send_before(sock, wire.encode_verdict(str(exc), code), deadline)
        except OSError:
            pass
        raise
