"""The TCP side of an aggregator: accept connections, authenticate them, read each worker's messages.

An `AggregatorServer` listens on a port and serves jobs (`aggregator.AggregatorJob`). A colocated
aggregator is a server inside a worker process that serves that worker's job only; a dedicated one
(`sparcoll aggregator`) serves every job that authenticates with its secret, each isolated. It survives
what the internet does to servers: the accept loop retries every failure (out of descriptors too), at
most `max_handshakes` connections may be handshaking at once, each handshake has one deadline, and a
bug costs only the connection it happened on.
"""
from __future__ import annotations

import functools
import logging
import resource
import socket
import threading
import time
from collections import OrderedDict, deque

import numpy as np
import torch

from . import transport, wire
from .aggregator import AggregatorJob
from .blocks import as_bytes
from .errors import PeerError, ProtocolError, SparcollError
from .lease import Lease
from .protocol import Result
from .throttled import Throttled

log = logging.getLogger("sparcoll.aggregator")

HANDSHAKE_TIMEOUT = 10.0      # for the whole handshake, however slowly the client trickles it
# Connections still in their handshake at once. Each holds a thread and a descriptor for at most
# HANDSHAKE_TIMEOUT; without a cap, anyone who can reach the port could exhaust both.
MAX_HANDSHAKES = 256
REFUSAL_LINGER = 1.0    # seconds a connection refused as busy stays half closed (BusyRefusals)
# Descriptors a dedicated aggregator keeps beside its handshakes' (the listening socket, its logs,
# what the process opens itself); admitted connections may take the rest of its descriptor limit.
SPARE_DESCRIPTORS = 64
ACCEPT_BACKOFF = 0.1          # after a failed accept (out of descriptors, say), before the next
ENDED_MEMORY = 1024           # jobs forgotten after a worker left, remembered to refuse their latecomers
CLOSE_JOIN = 5.0              # close() waits this long, at most, for the server's threads to end
# A message's body must follow its header within this: a worker sends both at once, and one that
# stalls in between (stopped, or a client holding the secret) held its receive buffer, up to 64 MiB,
# and its job for good. A 64 MiB body needs about 9 Mbit/s to make it.
BODY_DEADLINE = 60.0
# Results queue on a worker's connection while it reads them more slowly than they come. The
# aggregator reads a job's next message, from any of its workers, only while no connection of the
# job has more than SEND_BACKLOG_BYTES waiting: results come of the job's contributions (every
# rank's, so a rank that stops reading after its last message is held to it too), and one that never
# read them had 3.5 GB queued in 8.5 s. Waiting costs an honest job nothing: 64 MiB keep any link busy
# (5 ms at 100 Gbit/s), and a worker's receiver never waits on an aggregator. A job whose queue stays
# above it for SLOW_READER_DEADLINE fails (64 MiB in that time: about 9 Mbit/s).
SEND_BACKLOG_BYTES = 64 << 20
SLOW_READER_DEADLINE = 60.0
FROM_WORKERS = frozenset({wire.Kind.CONTRIBUTE, wire.Kind.ERROR, wire.Kind.BYE})


class BufferPool:
    """Receive buffers reused across messages: fresh large allocations cost page faults."""

    def __init__(self, keep: int):
        self._free: list[torch.Tensor] = []
        self._keep = keep
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.numel() >= nbytes:
                    return self._free.pop(i)
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buf)


class _RemoteWorker:
    """A worker reached over TCP: results and errors are sent on its connection."""

    def __init__(self, conn: transport.Connection):
        self.conn = conn

    def send_result(self, h: wire.Header, header: bytes, indices: np.ndarray, result: Result,
                    lease: Lease | None) -> None:
        self.conn.send([header, as_bytes(indices), as_bytes(result.rows)],
                       blocks=result.indices.size, lease=lease)

    def send_error(self, job: int, collective: int, code: wire.ErrorCode, text: str) -> None:
        self.conn.send(wire.error_message(job, collective, text, code))


class BusyRefusals:
    """Connections over the handshake limit, refused as busy (the client tries again later,
    transport.connect) without waiting for anything: the reason is sent and the connection half
    closed, and it is closed for good REFUSAL_LINGER seconds later. Closed at once with the client's
    HELLO unread, it was reset, and the client lost the reason with it. At most `limit` linger;
    one more closes the oldest."""

    def __init__(self, limit: int):
        self.limit = limit
        self._lingering: deque[tuple[float, socket.socket]] = deque()
        self._lock = threading.Lock()

    def refuse(self, sock: socket.socket) -> None:
        try:
            sock.setblocking(False)
            sock.send(wire.encode_verdict(f"{transport.BUSY}{self.limit} handshakes in progress, its limit",
                                          wire.ErrorCode.PEER))
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            sock.close()
            return
        with self._lock:
            self._lingering.append((time.monotonic() + REFUSAL_LINGER, sock))
            done = [self._lingering.popleft()[1] for _ in range(len(self._lingering) - self.limit)]
            while self._lingering and self._lingering[0][0] <= time.monotonic():
                done.append(self._lingering.popleft()[1])
        for old in done:
            old.close()

    def close(self) -> None:
        with self._lock:
            done, self._lingering = [sock for _, sock in self._lingering], deque()
        for sock in done:
            sock.close()


class AggregatorServer:
    """Accepts authenticated connections and serves each on its own receiver thread.

    `secret` authenticates clients; `only_job`, when set, restricts the server to that one job
    (a colocated aggregator); at most `max_handshakes` connections may be in their handshake at
    once, any more are closed at once; at most `max_connections` may be admitted at once (None:
    see connection_limit), any more are refused at their handshake with the reason."""

    def __init__(self, host: str, port: int, secret: bytes, only_job: int | None = None,
                 max_handshakes: int = MAX_HANDSHAKES, max_connections: int | None = None):
        if max_handshakes < 1:
            raise ValueError(f"max_handshakes={max_handshakes}: must be at least 1")
        if max_connections is not None and max_connections < 1:
            raise ValueError(f"max_connections={max_connections}: must be at least 1")
        self.secret = secret
        self.only_job = only_job
        self.jobs: dict[int, AggregatorJob] = {}
        self._lock = threading.Lock()
        self._connections: dict[transport.Connection, int] = {}    # each worker's, with its job
        self._ended: OrderedDict[int, str] = OrderedDict()     # job id -> why it ended
        self._serving: dict[threading.Thread, socket.socket] = {}   # each connection's thread
        self._closed = False
        self.max_handshakes = max_handshakes
        self.handshaking = 0                # connections in their handshake now
        self.max_connections = max_connections
        self.admitted = 0                   # connections admitted to a job, until they close
        # Flood warnings, rate-limited; each counts its occurrences.
        self.accept_failures = Throttled(log)
        self.over_cap = Throttled(log)        # connections closed at once: too many handshakes
        self.busy = BusyRefusals(max_handshakes)
        self.refused = Throttled(log)         # connections that failed their handshake
        self.sock = transport.listen(host, port, backlog=256)
        self.address = transport.format_address(host, self.sock.getsockname()[1])
        self.stats = transport.TrafficStats()   # of connections already closed
        self._accepter = threading.Thread(target=self._accept_loop, name="sparcoll-accept",
                                          daemon=True)
        self._accepter.start()

    def add_job(self, job: int, agg_index: int, config: wire.JobConfig,
                job_token: bytes) -> AggregatorJob:
        """The job of this process's own ranks (a colocated aggregator's)."""
        with self._lock:
            state = self.jobs[job] = AggregatorJob(job, agg_index, config, job_token, colocated=True,
                                                   backlog=transport.Backlog(SEND_BACKLOG_BYTES))
        return state

    def traffic(self) -> transport.TrafficStats:
        total = transport.TrafficStats()
        total.add(self.stats)
        for conn in list(self._connections):
            total.add(conn.stats)
        return total

    def _accept_loop(self) -> None:
        """Accepts until the server is closed, whatever fails meanwhile: a loop that ended on an
        error (EMFILE when a flood of connections used up the descriptors, ENOBUFS, ECONNABORTED,
        a thread that cannot start) would leave a server that looks alive and never accepts again."""
        while not self._closed:
            try:
                if not self._accept_one():
                    return
            except BaseException as exc:    # any: this thread must go on accepting
                if self._closed:
                    return
                self._back_off(f"accepting a connection failed ({exc})")

    def _accept_one(self) -> bool:
        """Accept a connection and start its thread; False once the server is closing."""
        sock, peer = self.sock.accept()
        if not self._start_handshake():
            # Counted before the close: whoever sees the connection closed sees it counted.
            self.over_cap.warn(f"closed a connection from {peer[0]}:{peer[1]} at once: "
                               f"{self.max_handshakes} handshakes are in progress, the limit")
            self.busy.refuse(sock)
            return True
        thread = threading.Thread(target=self._serve, args=(sock,), name="sparcoll-agg-recv", daemon=True)
        with self._lock:    # close() sets _closed, then takes its list of threads here
            closed = self._closed
            if not closed:
                self._serving[thread] = sock
        if closed:          # accepted as close() began: it would neither wake nor join it
            self._end_handshake()
            sock.close()
            return False
        try:
            thread.start()
        except BaseException as exc:
            with self._lock:
                self._serving.pop(thread, None)
            self._end_handshake()
            sock.close()
            self._back_off(f"starting a thread for a connection failed ({exc})")
        return True

    def _start_handshake(self) -> bool:
        """Take a handshake slot, if one is free."""
        with self._lock:
            if self.handshaking >= self.max_handshakes:
                return False
            self.handshaking += 1
            return True

    def _end_handshake(self) -> None:
        with self._lock:
            self.handshaking -= 1

    def _back_off(self, problem: str) -> None:
        """Log (rate-limited) and wait a little: whatever failed may be back at once, the loop must
        not spin on it."""
        self.accept_failures.warn(f"{problem}; retrying every {ACCEPT_BACKOFF:g} s")
        time.sleep(ACCEPT_BACKOFF)

    def connection_limit(self) -> tuple[int, str] | None:
        """How many connections may be admitted at once, and why that many; None: no limit here (a
        colocated aggregator's job bounds its own). Unless given, what the process's descriptor
        limit leaves beside the handshakes' and SPARE_DESCRIPTORS, and at least half of it (a limit
        below those): a holder of the secret who opened idle connections until the descriptors ran
        out made every honest handshake fail (accept() cannot even take it), where a refusal now
        says why."""
        if self.max_connections is not None:
            return self.max_connections, "max_connections"
        if self.only_job is not None:
            return None
        soft, left = self.descriptors_left()
        if soft is None:
            return None
        if left >= soft // 2:
            return left, (f"the descriptor limit {soft} less {self.max_handshakes} for handshakes "
                          f"and {SPARE_DESCRIPTORS} spare")
        return max(1, soft // 2), f"half the descriptor limit {soft}"

    def descriptors_left(self) -> tuple[int | None, int | None]:
        """(the process's descriptor limit, what it leaves for admitted connections beside the
        handshakes' and SPARE_DESCRIPTORS); (None, None) where it is unlimited."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            return None, None
        return soft, soft - self.max_handshakes - SPARE_DESCRIPTORS

    def _admit(self, hello: wire.Hello, job_token: bytes) -> None:
        if self.only_job is not None and hello.job != self.only_job:
            raise ProtocolError(f"this aggregator serves job {self.only_job:#x} only")
        limit = self.connection_limit()
        with self._lock:
            if limit is not None and self.admitted >= limit[0]:
                raise PeerError(f"this aggregator serves {self.admitted} connections, its limit "
                                f"({limit[1]}); try again once some close")
            if hello.job in self._ended:
                raise PeerError(f"job {hello.job:#x} already ended on this aggregator: "
                                f"{self._ended[hello.job]}")
            job = self.jobs.get(hello.job)
            if job is None:     # the first rank to arrive sets the job token
                job = self.jobs[hello.job] = AggregatorJob(
                    hello.job, hello.agg_index, hello.config, job_token,
                    backlog=transport.Backlog(SEND_BACKLOG_BYTES))
            job.admit(hello, job_token)
            self.admitted += 1

    def _serve(self, sock: socket.socket) -> None:
        """One connection's thread: the handshake (holding a handshake slot), then the worker's
        messages. Whatever goes wrong costs this connection only, and the thread ends cleanly."""
        try:
            try:
                hello = self._handshake(sock)
            finally:
                self._end_handshake()
            if hello is None:
                return
            try:
                self._attend(sock, hello)
            except BaseException:       # any: the connection closes, the server goes on
                log.exception("closed rank %d of job %#x after an internal error", hello.rank,
                              hello.job)
                sock.close()
            finally:
                self._release_admission()
        finally:
            with self._lock:
                self._serving.pop(threading.current_thread(), None)

    def _handshake(self, sock: socket.socket) -> wire.Hello | None:
        """The client's HELLO once it authenticated and was admitted; else None, the socket closed."""
        admitted: list[wire.Hello] = []

        def admit(hello: wire.Hello, job_token: bytes) -> None:
            self._admit(hello, job_token)
            admitted.append(hello)

        try:
            return transport.accept(sock, lambda hello: self.secret, admit, HANDSHAKE_TIMEOUT)
        except (SparcollError, OSError) as exc:
            self.refused.warn(f"refused a connection: {exc}")
        except BaseException:
            log.exception("refused a connection after an internal error in its handshake")
        sock.close()
        if admitted:    # admitted, then lost before the verdict: don't keep an empty job
            with self._lock:
                self.jobs[admitted[0].job].arriving.discard(admitted[0].rank)
            self._release_admission()
            self._forget_if_empty(admitted[0].job)
        return None

    def _release_admission(self) -> None:
        with self._lock:
            self.admitted -= 1

    def _attend(self, sock: socket.socket, hello: wire.Hello) -> None:
        """Attach an admitted worker to its job and serve its messages until it leaves."""
        with self._lock:
            job = self.jobs[hello.job]
        try:
            conn = transport.Connection(sock, f"rank {hello.rank} of job {hello.job:#x}",
                                        lambda exc: None, job.backlog)
        except BaseException as exc:    # its sender thread could not start (out of threads): the
            # rank's reservation goes, and its peers' collectives fail now, not at their deadline
            why = f"rank {hello.rank}: the aggregator could not serve its connection ({exc})"
            try:    # the rank is told too, on the socket itself (there is no sender to queue it to)
                sock.settimeout(1.0)
                sock.sendall(b"".join(wire.error_message(job.job, wire.CONNECTION, why, wire.ErrorCode.PEER)))
            except OSError:
                pass
            with self._lock:
                job.arriving.discard(hello.rank)
            job.detach(hello.rank, (wire.ErrorCode.PEER, why))
            self._forget_if_empty(job.job)
            raise
        # Admission reserved this rank in its job, which is kept until it is attached: the others
        # may have failed and left meanwhile, and this worker then learns why from the job.
        with self._lock:
            self._connections[conn] = job.job
            job.attach(hello.rank, _RemoteWorker(conn))
        try:
            job.detach(hello.rank, self._receive(conn, job, hello.rank))
        finally:
            conn.close()
            with self._lock:
                self._connections.pop(conn, None)
                self.stats.add(conn.stats)
            self._forget_if_empty(job.job)

    def _forget_if_empty(self, job_id: int) -> None:
        """Drop a job nobody is attached to or arriving for. One a worker left is remembered: a rank
        that comes after (it connects later than the others) is refused with the reason, instead of
        starting the job anew and waiting for peers that gave up."""
        with self._lock:
            job = self.jobs.get(job_id)
            if job is not None and not job.workers and not job.arriving and self.only_job is None:
                self.jobs.pop(job_id, None)
                if job.broken is not None:
                    # as much as a refusal carries: a worker's reason may be 64 KiB, kept for good
                    self._ended[job_id] = job.broken[1][:wire.MAX_REASON_BYTES]
                    while len(self._ended) > ENDED_MEMORY:
                        self._ended.popitem(last=False)

    def _receive(self, conn: transport.Connection, job: AggregatorJob,
                 rank: int) -> tuple[wire.ErrorCode, str] | None:
        """Read and dispatch a worker's messages until it leaves; returns why it left, as the code
        and text its collectives fail with (None: a BYE without a reason)."""
        pool = BufferPool(keep=2 * job.config.streams * job.config.credits)
        landed: list[torch.Tensor] = []

        def place(h: wire.Header, indices: np.ndarray) -> list[memoryview]:
            nbytes = h.payload_sizes()[1]
            landed.append(pool.take(nbytes))
            return [as_bytes(landed[-1])[:nbytes]]

        try:
            while True:
                if job.backlog.over:
                    slow = job.backlog.wait(SLOW_READER_DEADLINE)
                    if slow:
                        why = (f"results waited to be sent for over {SLOW_READER_DEADLINE:.0f} s "
                               f"to workers that did not read them: "
                               + ", ".join(f"{c.peer} ({c.unsent >> 20} MiB)" for c in slow))
                        log.warning("closing %s: %s", conn.peer, why)
                        for c in slow:      # they go too, and what waits for them
                            c.cut()
                        return wire.ErrorCode.PEER, why
                h = conn.recv_header(job.config.message_blocks, job.job)
                body = functools.partial(conn.recv_into, deadline=time.monotonic() + BODY_DEADLINE)
                message = wire.read_body(h, body, FROM_WORKERS, place)
                if isinstance(message, wire.Blocks):
                    buf = landed.pop()
                    rows = buf[:h.payload_sizes()[1]].view(h.torch_dtype).view(h.count, h.block_size)
                    conn.count(blocks_received=h.count)
                    job.contribute(rank, h, message.indices, rows,
                                   Lease(functools.partial(pool.give, buf)), reuse=1)
                elif isinstance(message, wire.Failure):     # said by this rank, whatever it says
                    said = message.text if message.text.startswith(f"rank {rank}: ") else \
                        f"rank {rank}: {message.text}"
                    job.fail(message.collective, message.code, said)
                elif message.text:          # left after an error: that error is the reason
                    return message.code, (message.text if message.text.startswith(f"rank {rank} ")
                                          else f"rank {rank} left the job: {message.text}")
                else:
                    return None
        except ProtocolError as exc:
            log.warning("closing %s: %s", conn.peer, exc)
            return self._closing(conn, job, f"rank {rank} sent a malformed message ({exc})")
        except (PeerError, OSError) as exc:
            if self._closed:
                return wire.ErrorCode.PEER, "the aggregator is shutting down"
            return wire.ErrorCode.PEER, f"rank {rank} disconnected ({exc})"
        except BaseException as exc:    # any bug costs this connection, never the thread's clean-up
            log.exception("closing %s after an internal error", conn.peer)
            return self._closing(conn, job, f"rank {rank}: internal error in the aggregator "
                                            f"({type(exc).__name__}: {exc})")

    @staticmethod
    def _closing(conn: transport.Connection, job: AggregatorJob,
                 why: str) -> tuple[wire.ErrorCode, str]:
        """Tell the worker why its connection closes (its peers hear it from the job), before the
        close that follows, which flushes it; returns the reason for the job."""
        try:
            conn.send(wire.error_message(job.job, wire.CONNECTION, why, wire.ErrorCode.PROTOCOL))
        except Exception:   # the job must still hear why (the caller detaches the rank with it)
            log.exception("could not tell %s why its connection closes", conn.peer)
        return wire.ErrorCode.PEER, why

    def connections(self) -> int:
        """Worker connections being served."""
        with self._lock:
            return len(self._connections)

    def close(self, reason: str | None = None) -> None:
        """Stop accepting, end every connection, and wait (at most CLOSE_JOIN) for the threads: one
        still ending when the interpreter exits is stopped inside its clean-up, and where that frees
        a tensor, torch's destructor cannot unwind and the process aborts ("terminate called
        without an active exception": 7 of 129 runs of a 4-rank DataParallel script that closed and
        exited at once, before this wait; 0 of 40 after). `reason`: told to every worker first, as
        the error its communicator fails with (else it reads only that the connection closed)."""
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        with self._lock:
            connections, serving = dict(self._connections), dict(self._serving)
        for conn, job in connections.items() if reason else ():
            try:
                conn.send(wire.error_message(job, wire.CONNECTION, reason, wire.ErrorCode.PEER))
            except Exception:   # a connection already broken closes without it
                pass
        transport.close_all(connections)
        for sock in serving.values():      # wakes a handshake that is still reading
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + CLOSE_JOIN
        for thread in (self._accepter, *serving):
            if thread is not threading.current_thread():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self.busy.close()       # (after the accept loop, which refuses)
