"""Malformed input: the wire decoders, a live AggregatorServer and a worker facing a bad aggregator.

The decoders must turn any bytes into a validated message or a ProtocolError, nothing else. The live
server is attacked in-process (random bytes, truncated and mutated handshakes, valid handshakes then
garbage, every field of a header out of range, bad block indices, over-credit and over-collective floods)
while an honest two-rank job runs on the same server; afterwards the honest job's results were exact,
no server thread died, no job or connection leaked, and no receive buffer larger than the header checks
allow was ever requested. Example counts are fixed so the file stays fast.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings, strategies as st

from sparcoll import server as server_module, transport, wire, worker
from sparcoll.communicator import Communicator
from sparcoll.errors import ProtocolError, SparcollError
from support import wait_for

SECRET = b"fuzz-secret-0123456789"   # at least 16 bytes, as shared_secret requires
CFG = wire.JobConfig(world=2, num_aggs=1, streams=2, credits=2, message_blocks=64)
DESC = (64 * 256, 256, 0, 0)          # 64 blocks of 256 float32; stream 0 is [0, 32), 1 is [32, 64)
HONEST_NUMEL = 1 << 15
def fast(examples: int) -> settings:
    """Fixed example counts, no example database, the same examples every run (no flakiness)."""
    return settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck),
                    derandomize=True, database=None)


# ---- decoders ------------------------------------------------------------------------------------
def check_header_invariants(h: wire.Header, max_blocks: int, job: int) -> None:
    assert h.job == job
    assert h.kind in wire.Kind
    if h.kind in (wire.Kind.CONTRIBUTE, wire.Kind.RESULT):
        assert h.dtype in wire.DTYPES and h.op in (0, 1, wire.COO_OP, wire.COO_OP | 1)
        assert 1 <= h.block_size <= wire.MAX_BLOCK_SIZE
        assert h.count <= max_blocks
        assert h.progress <= -(-h.numel // h.block_size) <= wire.MAX_BLOCKS
        if h.kind is wire.Kind.CONTRIBUTE:
            assert sum(h.payload_sizes()) <= wire.MAX_MESSAGE_BYTES + max_blocks * wire.INDEX_BYTES
    elif h.kind is wire.Kind.ERROR:
        assert h.count <= wire.MAX_ERROR_BYTES


@fast(300)
@given(st.binary(max_size=3 * wire.HEADER_BYTES))
def test_decode_header_random_bytes(raw):
    try:
        h = wire.decode_header(raw, 64, 7)
    except ProtocolError:
        return
    check_header_invariants(h, 64, 7)


def _u(bits):
    return st.one_of(st.integers(0, 4), st.integers(0, (1 << bits) - 1),
                     st.sampled_from([(1 << bits) - 1, 1 << (bits - 1)]))


header_fields = st.fixed_dictionaries(dict(
    magic=st.sampled_from([wire.MAGIC, wire.MAGIC, b"SPCM", b"\0\0\0\0"]),
    version=st.sampled_from([wire.VERSION, wire.VERSION, 0, 2, 255]),
    kind=st.integers(0, 6), stream=_u(16), job=st.sampled_from([7, 7, 8, 0, (1 << 64) - 1]),
    collective=_u(64), seq=_u(32), count=_u(32), progress=_u(64), numel=_u(64),
    block_size=_u(32), dtype=_u(8), op=_u(8)))


def pack(f: dict) -> bytes:
    return wire._HEADER.pack(f["magic"], f["version"], f["kind"], f["stream"], f["job"],
                             f["collective"], f["seq"], f["count"], f["progress"], f["numel"],
                             f["block_size"], f["dtype"], f["op"], 0)


@fast(600)
@given(header_fields, st.sampled_from([1, 64, 8192]))
def test_decode_header_every_field_out_of_range(fields, max_blocks):
    try:
        h = wire.decode_header(pack(fields), max_blocks, 7)
    except ProtocolError:
        return
    check_header_invariants(h, max_blocks, 7)


@fast(300)
@given(st.binary(min_size=wire.HELLO_BYTES, max_size=wire.HELLO_BYTES) | st.binary(max_size=100),
       st.booleans())
def test_hello_decode(raw, fix_magic):
    if fix_magic and len(raw) == wire.HELLO_BYTES:
        raw = wire.MAGIC + bytes([wire.VERSION]) + raw[5:]
    try:
        hello = wire.Hello.decode(raw)
    except ProtocolError:
        return
    hello.config.check()
    assert hello.rank < hello.config.world and hello.agg_index < hello.config.num_aggs


# The handshake messages after HELLO: magic (4 bytes), version (1), then the fields. The reference
# decoders below slice the bytes by that layout, independently of wire's struct formats.
PREFIX = wire.MAGIC + bytes([wire.VERSION])
_N, _M = wire.NONCE_BYTES, wire.MAC_BYTES
HANDSHAKE = {   # name: (decoder, its size, reference decoding of well-formed bytes)
    "challenge": (wire.decode_challenge, 5 + _N + _M,
                  lambda raw: (raw[5:5 + _N], raw[5 + _N:5 + _N + _M])),     # nonce, server MAC
    "proof": (wire.decode_proof, 5 + 2 * _M,
              lambda raw: (raw[5:5 + _M], raw[5 + _M:5 + 2 * _M])),          # client MAC, job token
    "verdict": (wire.decode_verdict, 5 + 3,                                # code, reason length
                lambda raw: (wire.error_code(raw[5]), int.from_bytes(raw[6:8], "little"))),
}


@fast(200)
@given(st.sampled_from(list(HANDSHAKE)), st.binary(min_size=80, max_size=80),
       st.sampled_from(["random", "magic", "magic+version"]))
def test_handshake_decoders(name, raw, prefix):
    """Bytes of the right size: the fields (as the reference slices them) if magic and version are
    right, else a ProtocolError."""
    decode, size, reference = HANDSHAKE[name]
    raw = raw[:size]
    if prefix == "magic":
        raw = wire.MAGIC + raw[4:]                  # the version byte stays random
    elif prefix == "magic+version":
        raw = PREFIX + raw[5:]
    if raw[:5] != PREFIX:
        with pytest.raises(ProtocolError, match="bad magic|unsupported protocol version"):
            decode(raw)
    else:
        assert decode(raw) == reference(raw)


@pytest.mark.parametrize("name", list(HANDSHAKE))
def test_handshake_decoders_refuse_wrong_lengths(name):
    decode, size, _ = HANDSHAKE[name]
    well_formed = PREFIX + bytes(range(size - 5))
    for raw in (b"", PREFIX, well_formed[:-1], well_formed + b"\0", well_formed * 2):
        message = f"\\b{len(raw)} bytes, expected {size}\\b"   # both lengths named
        with pytest.raises(ProtocolError, match=message):
            decode(raw)
        with pytest.raises(ProtocolError, match=message):
            decode(bytearray(raw))                  # as read from a socket


def test_handshake_round_trips_and_bad_magic_or_version():
    nonce, server_mac, client_mac, token = (os.urandom(32) for _ in range(4))
    reason = "refused: caf\u00e9 \u2615"               # non-ASCII: the length counts bytes
    cases = [(wire.encode_challenge(nonce, server_mac), wire.decode_challenge, (nonce, server_mac)),
             (wire.encode_proof(client_mac, token), wire.decode_proof, (client_mac, token)),
             (wire.encode_proof(client_mac), wire.decode_proof, (client_mac, bytes(32))),
             (wire.encode_verdict(), wire.decode_verdict, (wire.ErrorCode.AUTHENTICATION, 0)),
             (wire.encode_verdict(reason), wire.decode_verdict,
              (wire.ErrorCode.AUTHENTICATION, len(reason.encode()))),
             (wire.encode_verdict(reason, wire.ErrorCode.MISMATCH), wire.decode_verdict,
              (wire.ErrorCode.MISMATCH, len(reason.encode())))]
    for raw, decode, expected in cases:
        fixed = raw[:wire.VERDICT_BYTES] if decode is wire.decode_verdict else raw
        assert decode(bytearray(fixed)) == expected
        with pytest.raises(ProtocolError, match="bad magic"):
            decode(b"SPCX" + fixed[4:])
        with pytest.raises(ProtocolError, match=f"unsupported protocol version {wire.VERSION + 1}"):
            decode(fixed[:4] + bytes([wire.VERSION + 1]) + fixed[5:])
    verdict = wire.encode_verdict(reason)
    assert verdict[wire.VERDICT_BYTES:].decode() == reason     # the text follows the fixed part


# ---- a worker facing a malformed aggregator ------------------------------------------------------
class FakeAggregator:
    """Authenticates a worker with the real handshake, reads its contributions, then answers with
    whatever `respond(hello, header)` returns (bytes, or a list of bytes and pauses in seconds), or
    closes when it returns None."""

    def __init__(self, respond):
        self.respond = respond
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        try:
            hello = transport.accept(conn, lambda h: SECRET, lambda h, token: None, 5.0)
            conn.settimeout(10)
            buf = bytearray(wire.HEADER_BYTES)
            transport._recv_exact(conn, memoryview(buf), "worker")
            h = wire.decode_header(buf, hello.config.message_blocks, hello.job)
            payload = bytearray(sum(h.payload_sizes()))
            transport._recv_exact(conn, memoryview(payload), "worker")
            reply = self.respond(hello, h)
            for part in reply if isinstance(reply, list) else [reply]:   # bytes, or a pause (s)
                if isinstance(part, float):
                    time.sleep(part)
                elif part is not None:
                    conn.sendall(part)
            time.sleep(0.5)
        except (OSError, SparcollError):
            pass
        finally:
            conn.close()

    def close(self):
        self.sock.close()
        self.thread.join(10)


def _result(h, job, *, collective=None, seq=0, indices=(), progress=None, desc=None, count=None,
            data=None, **override):
    desc = desc or h.descriptor
    idx = np.asarray(indices, dtype=np.int32)
    count = idx.size if count is None else count
    raw = header(job, wire.Kind.RESULT, stream=h.stream,
                 collective=h.collective if collective is None else collective, seq=seq,
                 count=count, progress=h.progress if progress is None else progress, desc=desc,
                 **override)
    rows = np.ones(idx.size * desc[1], dtype=np.float32).tobytes() if data is None else data
    return raw + idx.tobytes() + rows


# name -> reply to the worker's first contribution (the worker reduces 16 blocks, all non-zero)
BAD_RESULTS = {
    "close-without-answer": lambda hello, h: None,
    "bad-magic": lambda hello, h: header(hello.job, wire.Kind.RESULT, magic=b"NOPE"),
    "wrong-job": lambda hello, h: _result(h, hello.job ^ 5),
    "wrong-seq": lambda hello, h: _result(h, hello.job, seq=3, indices=range(16), progress=16),
    "progress-beyond-range": lambda hello, h: _result(h, hello.job, progress=17),
    "index-out-of-range": lambda hello, h: _result(h, hello.job, indices=[0, 20], progress=16),
    "indices-unsorted": lambda hello, h: _result(h, hello.job, indices=[5, 1], progress=16),
    "omits-my-blocks": lambda hello, h: _result(h, hello.job, indices=[0], progress=16),
    "descriptor-changed": lambda hello, h: _result(h, hello.job, indices=range(16), progress=16,
                                                   desc=(h.numel, h.block_size, 3, 0)),
    "count-over-limit": lambda hello, h: _result(h, hello.job, count=10 ** 6, progress=16),
    "truncated-data": lambda hello, h: _result(h, hello.job, indices=range(16), progress=16)[:3000],
    "error-message": lambda hello, h: b"".join(wire.error_message(hello.job, h.collective,
                                                                  "injected", wire.ErrorCode.PEER)),
    "kind-contribute": lambda hello, h: header(hello.job, wire.Kind.CONTRIBUTE),
}


WORKER_TIMEOUT = 3.0


def _rank_of_one(fake) -> Communicator:
    """A job of one rank whose aggregator is `fake`."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPARCOLL_SECRET", SECRET.decode())
        return Communicator(dist.HashStore(), 0, 1, aggregators=[fake.address], timeout=WORKER_TIMEOUT)


def _worker_against(respond, numel=4096):
    fake = FakeAggregator(respond)
    try:
        comm = _rank_of_one(fake)
        t = time.monotonic()
        try:
            comm.allreduce(torch.ones(numel))
            outcome = "NO ERROR"
        except SparcollError as exc:
            outcome = type(exc).__name__ + ": " + str(exc)
        except Exception as exc:
            outcome = "UNEXPECTED " + type(exc).__name__ + ": " + str(exc)
        elapsed = time.monotonic() - t
        t = time.monotonic()
        comm.close()
        return outcome, elapsed, time.monotonic() - t
    finally:
        fake.close()


@pytest.mark.parametrize("name", list(BAD_RESULTS))
def test_worker_rejects_malformed_results(name):
    outcome, elapsed, close_s = _worker_against(BAD_RESULTS[name])
    assert outcome.split(":")[0] in ("ProtocolError", "PeerError", "CollectiveTimeout"), outcome
    if name == "error-message":
        assert outcome.startswith("PeerError") and "injected" in outcome
    if name == "truncated-data":
        # The aggregator leaves in the middle of a result's data: the range is not finished (its
        # header was accepted, its data never arrived), so the worker fails at once naming it
        # instead of waiting for its deadline.
        assert outcome.startswith("PeerError") and "aggregator 0" in outcome, outcome
    # Every reply leaves within the worker's deadline, not the 60 s default; the bound is loose
    # enough for a loaded machine.
    assert elapsed < 10 * WORKER_TIMEOUT and close_s < 8.0, (elapsed, close_s)


def test_a_results_data_that_stalls_half_way_never_lands_after_the_call_returned():
    """The aggregator sends a result's header and half its data, stalls past the collective's
    deadline (a stopped process, a frozen host), then sends the rest: the worker's receiver, blocked
    in that data, wrote it into the tensor after the call had raised and handed the tensor back. Now
    the failed collective cuts that connection once SETTLE_S has passed with the data unfinished."""
    from sparcoll.errors import SETTLE_S

    def respond(hello, h):
        message = _result(h, hello.job, indices=range(16), progress=16,
                           data=np.full(16 * 256, 5.0, np.float32).tobytes())
        half = len(message) - 8 * 256 * 4
        return [message[:half], WORKER_TIMEOUT + 2 * SETTLE_S + 1.0, message[half:]]

    fake = FakeAggregator(respond)
    try:
        comm = _rank_of_one(fake)
        tensor = torch.ones(4096)
        with pytest.raises(SparcollError):
            comm.allreduce(tensor)
        returned = tensor.clone()
        fake.thread.join(3 * WORKER_TIMEOUT)        # it sent the rest (or found the connection cut)
        time.sleep(0.5)
        assert torch.equal(tensor, returned), "the rest of the result landed after the call returned"
        comm.close()
    finally:
        fake.close()


def test_worker_reads_results_of_a_collective_it_does_not_run_through_its_small_discard_buffer(monkeypatch):
    """8 MiB of results for a collective this rank is not running (one it gave up, say) are read
    and dropped through the receiver's 1 MiB discard buffer, not into memory of their size."""
    blocks, block_size = 4096, 256                 # the most one message may carry in this job
    dropped = []
    real_place = worker._ResultPlacement.place

    def place(self, h, indices):
        views = real_place(self, h, indices)
        if h.collective == 999:
            start = self.discard.data_ptr()
            dropped.extend((np.frombuffer(v, np.uint8).ctypes.data - start, len(v)) for v in views)
        return views

    def respond(hello, h):    # the result of collective 999: float64 blocks, 8 MiB of data
        return _result(h, hello.job, collective=999, indices=range(blocks), progress=0,
                       desc=(blocks * block_size, block_size, wire.DTYPE_CODES[torch.float64], 0),
                       data=np.ones(blocks * block_size).tobytes())

    monkeypatch.setattr(worker._ResultPlacement, "place", place)
    outcome, _, _ = _worker_against(respond)
    assert outcome.startswith(("PeerError", "CollectiveTimeout")), outcome    # its own result never came
    assert sum(size for _, size in dropped) == blocks * block_size * 8, dropped
    assert all(0 <= offset and offset + size <= worker.DISCARD_BYTES for offset, size in dropped), dropped


# ---- a live server under attack, an honest job beside it -----------------------------------------
class Watch:
    """Uncaught thread exceptions, the largest receive buffer requested, warnings logged."""

    def __init__(self):
        self.thread_errors: list[str] = []
        self.max_take = 0
        self.records: list[str] = []


class _Handler(logging.Handler):
    def __init__(self, watch):
        super().__init__(logging.WARNING)
        self.watch = watch

    def emit(self, record):
        if len(self.watch.records) < 100_000:
            self.watch.records.append(record.getMessage())


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


@pytest.fixture(scope="module")
def live():
    watch = Watch()
    original_hook = threading.excepthook
    original_take = server_module.BufferPool.take

    def hook(args):
        watch.thread_errors.append(f"{args.thread.name}: {args.exc_type.__name__}: {args.exc_value}")
        original_hook(args)

    def take(self, nbytes):
        watch.max_take = max(watch.max_take, nbytes)
        return original_take(self, nbytes)

    handler = _Handler(watch)
    log = logging.getLogger("sparcoll.aggregator")
    with pytest.MonkeyPatch.context() as patch:     # every hook is undone however the module ends
        patch.setattr(threading, "excepthook", hook)
        patch.setattr(server_module.BufferPool, "take", take)
        log.addHandler(handler)
        server = server_module.AggregatorServer("127.0.0.1", 0, SECRET)
        honest = Honest(server.address)
        try:
            honest.start()
            rss_before = rss_mb()
            yield server, honest, watch
        finally:
            try:
                honest.stop()
            finally:
                server.close()
                log.removeHandler(handler)
    # checks of the whole session, after every fuzz test of this module ran
    print(f"\nhonest job: {honest.done} exact collectives during the attacks; largest receive "
          f"buffer requested: {watch.max_take} bytes; {len(watch.records)} warnings logged")
    assert not watch.thread_errors, watch.thread_errors
    assert honest.errors == [], honest.errors
    assert honest.done >= 3 and honest.inexact == 0, (honest.done, honest.inexact)
    assert rss_mb() - rss_before < 400, "the server's memory grew without bound"


class Honest:
    """Two in-process ranks of a job on the attacked server, reducing until told to stop."""

    def __init__(self, address):
        self.address = address
        self.stop_event = threading.Event()
        self.errors: list[str] = []
        self.done = 0
        self.inexact = 0
        self.job = None
        self.threads = []

    def start(self):
        with pytest.MonkeyPatch.context() as patch:     # until both ranks are connected
            patch.setenv("SPARCOLL_SECRET", SECRET.decode())
            self._start()

    def _start(self):
        store = dist.HashStore()
        stopping = [False]

        def decide():               # run once per round by the barrier: both ranks see one answer
            stopping[0] = self.stop_event.is_set()
        ready = threading.Barrier(2, action=decide, timeout=30)

        def run(rank):
            try:
                with Communicator(dist.PrefixStore("h/", store), rank, 2, aggregators=[self.address],
                                  timeout=20, message_blocks=16) as comm:
                    ready.wait()
                    self.job = comm.job     # both ranks are connected: the secret may go
                    k = 0
                    while k < 2000:
                        ready.wait()
                        if stopping[0]:
                            break
                        x = _honest_input(k, rank)
                        comm.allreduce(x)
                        if rank == 0:
                            self.done += 1
                            self.inexact += not torch.equal(
                                x, _honest_input(k, 0) + _honest_input(k, 1))
                        k += 1
                        time.sleep(0.01)
            except BaseException as exc:
                self.errors.append(f"rank {rank}: {type(exc).__name__}: {exc}")
        self.threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + 20
        while self.job is None and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self):
        self.stop_event.set()
        for t in self.threads:
            t.join(30)
        assert not any(t.is_alive() for t in self.threads), "the honest job hung"


def _honest_input(k, rank):
    g = torch.Generator().manual_seed(k * 10 + rank)
    x = torch.randint(-3, 4, (HONEST_NUMEL // 256, 256), generator=g).float()
    x[torch.rand(HONEST_NUMEL // 256, generator=g) < 0.5] = 0
    return x.view(-1)


def handshake(address, job, rank=0, config=CFG, agg_index=0, secret=SECRET) -> socket.socket:
    hello = wire.Hello(job, rank, agg_index, config, os.urandom(wire.NONCE_BYTES))
    sock = transport.connect(address, hello, secret, 5.0)
    sock.settimeout(5.0)
    return sock


def send_and_drain(sock: socket.socket, payload: bytes, limit: float = 5.0) -> tuple[bytes, bool]:
    """Send, half-close, read until the server closes; (what it sent back, whether it closed)."""
    got = bytearray()
    try:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass                        # the server already dropped us: fine
    deadline = time.monotonic() + limit
    closed = False
    try:
        while time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = sock.recv(65536)
            if not chunk:
                closed = True
                break
            if len(got) < 1 << 20:
                got += chunk
    except (ConnectionResetError, BrokenPipeError):
        closed = True
    except socket.timeout:
        pass
    finally:
        sock.close()
    return bytes(got), closed


def port_of(server) -> int:
    return int(server.address.rsplit(":", 1)[1])


def only_honest_left(server, honest) -> bool:
    return set(server.jobs) <= {honest.job} and len(server._connections) <= 2


def header(job, kind=wire.Kind.CONTRIBUTE, *, stream=0, collective=1, seq=0, count=0, progress=0,
           desc=DESC, **override) -> bytes:
    f = dict(magic=wire.MAGIC, version=wire.VERSION, kind=int(kind), stream=stream, job=job,
             collective=collective, seq=seq, count=count, progress=progress, numel=desc[0],
             block_size=desc[1], dtype=desc[2], op=desc[3])
    f.update(override)
    return pack(f)


def contribution(job, indices, progress, *, stream=0, collective=1, seq=0, desc=DESC) -> bytes:
    idx = np.asarray(indices, dtype=np.int32)
    data = np.ones(idx.size * desc[1], dtype=np.float32).tobytes()
    return header(job, stream=stream, collective=collective, seq=seq, count=idx.size,
                  progress=progress, desc=desc) + idx.tobytes() + data


BIG_CFG = wire.JobConfig(world=2, num_aggs=1, streams=1, credits=2, message_blocks=65536)

# name -> (config, bytes after the handshake given the job id, reason the server must log)
MALFORMED = {
    "bad-magic": (CFG, lambda j: header(j, magic=b"XXXX"), "bad magic"),
    "bad-version": (CFG, lambda j: header(j, version=9), "unsupported protocol version"),
    "unknown-kind": (CFG, lambda j: header(j, kind=9), "unknown message kind"),
    "unknown-dtype": (CFG, lambda j: header(j, dtype=7), "unknown dtype"),
    "unknown-op": (CFG, lambda j: header(j, op=5), "unknown op"),
    "block-size-zero": (CFG, lambda j: header(j, block_size=0), "block size 0"),
    "block-size-huge": (CFG, lambda j: header(j, block_size=(1 << 32) - 1), "out of range"),
    "count-over-message-blocks": (CFG, lambda j: header(j, count=65), "limit is 64"),
    "count-2^32-1": (CFG, lambda j: header(j, count=(1 << 32) - 1), "limit is 64"),
    "message-over-64MiB": (BIG_CFG, lambda j: header(j, count=65536, numel=1 << 40,
                                                       block_size=512), "exceeds"),
    "progress-beyond-tensor": (CFG, lambda j: header(j, progress=65), "beyond the 64 blocks"),
    "wrong-job-id": (CFG, lambda j: header(j ^ 1), "on a connection of job"),
    "error-text-too-long": (CFG, lambda j: header(j, wire.Kind.ERROR, count=(1 << 16) + 1),
                            "exceeds"),
    "result-from-a-worker": (CFG, lambda j: header(j, wire.Kind.RESULT), "unexpected RESULT"),
    "index-beyond-stream": (CFG, lambda j: contribution(j, [40], 32), "outside"),
    "index-negative": (CFG, lambda j: contribution(j, [-1], 5), "outside"),
    "index-at-progress": (CFG, lambda j: contribution(j, [10], 10), "outside"),
    "indices-repeated": (CFG, lambda j: contribution(j, [3, 3], 10), "not strictly increasing"),
    "indices-descending": (CFG, lambda j: contribution(j, [5, 2], 10), "not strictly increasing"),
    "progress-not-advancing": (CFG, lambda j: contribution(j, [1], 5)
                               + contribution(j, [], 5, seq=1), "progress 5 not in"),
    "progress-beyond-stream": (CFG, lambda j: contribution(j, [1], 40), "not in"),
    "seq-skipped": (CFG, lambda j: contribution(j, [1], 5, seq=1), "seq 1, expected 0"),
    "stream-out-of-range": (CFG, lambda j: contribution(j, [1], 5, stream=5), "stream 5 of 2"),
    "over-credits": (CFG, lambda j: b"".join(contribution(j, [i], i + 1, seq=i) for i in range(3)),
                     "exceeded its 2 credits"),
    "too-many-collectives": (CFG, lambda j: b"".join(contribution(j, [0], 1, collective=c)
                                                     for c in range(1, 40)), "limit is 16"),
    "truncated-header": (CFG, lambda j: header(j)[:30], None),     # a disconnect, not a message
    "truncated-payload": (CFG, lambda j: contribution(j, [1, 2, 3, 4], 5)[:2000], None),
    "valid-then-garbage": (CFG, lambda j: contribution(j, [1], 2) + os.urandom(56), "rank 0"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_message_closes_only_that_connection(name, live):
    server, honest, watch = live
    config, make, reason = MALFORMED[name]
    job = int.from_bytes(os.urandom(8), "little")
    before = len(watch.records)
    sock = handshake(server.address, job, config=config)
    got, closed = send_and_drain(sock, make(job))
    assert closed, f"{name}: the server kept the connection open"
    assert wait_for(lambda: job not in server.jobs), f"{name}: job state leaked"
    if reason is not None:
        assert wait_for(lambda: any(reason in r for r in watch.records[before:])), \
            (name, reason, watch.records[before:][-5:])
        assert _why_closed(got, job) is not None and reason in _why_closed(got, job), (name, got[-300:])
    assert watch.max_take <= wire.MAX_MESSAGE_BYTES


def _why_closed(got: bytes, job: int) -> str | None:
    """The text of the ERROR for the connection itself (collective CONNECTION) among the messages
    a server sent before it closed, if there is one."""
    at = 0
    while at + wire.HEADER_BYTES <= len(got):
        h = wire.decode_header(got[at:at + wire.HEADER_BYTES], 64, job)
        at += wire.HEADER_BYTES + sum(h.payload_sizes())
        if h.kind is wire.Kind.ERROR and h.collective == wire.CONNECTION:
            assert h.op == wire.ErrorCode.PROTOCOL and at == len(got), (h, at, len(got))
            return got[at - h.count:at].decode()
    return None


def test_descriptor_mismatch_fails_the_collective_on_both_clients(live):
    """Two clients of one job disagree on numel: both get an ERROR (MISMATCH) for that collective."""
    server, honest, watch = live
    job = int.from_bytes(os.urandom(8), "little")
    socks = [handshake(server.address, job, rank=r) for r in range(2)]
    other = (DESC[0] - 256, *DESC[1:])
    socks[0].sendall(contribution(job, [1], 32))
    socks[1].sendall(contribution(job, [1], 31, desc=other))
    for sock in socks:
        h = wire.decode_header(_recv_exactly(sock, wire.HEADER_BYTES), 64, job)
        assert h.kind is wire.Kind.ERROR and h.op == wire.ErrorCode.MISMATCH, h
        assert b"numel" in _recv_exactly(sock, h.count)
    for sock in socks:
        send_and_drain(sock, wire.bye_message(job))
    assert wait_for(lambda: job not in server.jobs)


def _recv_exactly(sock, n):
    buf = bytearray(n)
    transport._recv_exact(sock, memoryview(buf), "server")
    return bytes(buf)


@fast(120)
@given(st.binary(max_size=200))
def test_random_bytes_before_the_handshake(live, raw):
    server, honest, watch = live
    sock = socket.create_connection(("127.0.0.1", port_of(server)), timeout=5)
    _, closed = send_and_drain(sock, raw)
    assert closed
    assert only_honest_left(server, honest) or wait_for(lambda: only_honest_left(server, honest))


@fast(100)
@given(st.fixed_dictionaries(dict(
    job=st.sampled_from([1, 2, (1 << 64) - 1]), rank=_u(32), world=_u(32), agg_index=_u(16),
    num_aggs=_u(16), streams=_u(16), credits=_u(16), message_blocks=_u(32))),
    st.binary(min_size=wire.PROOF_BYTES, max_size=wire.PROOF_BYTES))
def test_mutated_hello_without_the_secret_never_reaches_a_job(live, f, proof):
    server, honest, watch = live
    raw = wire._HELLO.pack(wire.MAGIC, wire.VERSION, 0, f["job"], f["rank"], f["world"],
                           f["agg_index"], f["num_aggs"], f["streams"], f["credits"],
                           f["message_blocks"], os.urandom(wire.NONCE_BYTES))
    sock = socket.create_connection(("127.0.0.1", port_of(server)), timeout=5)
    _, closed = send_and_drain(sock, raw + proof)
    assert closed
    assert f["job"] not in server.jobs


message = st.one_of(
    st.binary(min_size=1, max_size=300),
    st.tuples(header_fields, st.binary(max_size=2048)).map(lambda t: pack(t[0]) + t[1]),
    st.tuples(st.lists(st.integers(-3, 70), max_size=6), st.integers(0, 70), st.integers(0, 3),
              st.integers(0, 3), st.integers(1, 3)).map(
        lambda t: ("contribution",) + t),
)


@fast(200)
@given(st.lists(message, min_size=1, max_size=4))
def test_authenticated_client_sending_garbage(live, messages):
    """A client holding the secret sends anything at all; the server never crashes or hangs, closes or
    keeps serving the connection, frees the job when the client leaves, and bounds its buffers."""
    server, honest, watch = live
    job = int.from_bytes(os.urandom(8), "little") | 2
    sock = handshake(server.address, job)
    out = b""
    for m in messages:
        if isinstance(m, tuple):
            _, indices, progress, stream, seq, collective = m
            out += contribution(job, indices, progress, stream=stream, seq=seq,
                                collective=collective)
        else:
            out += m.replace(b"\x07\x00\x00\x00\x00\x00\x00\x00", job.to_bytes(8, "little"))
    _, closed = send_and_drain(sock, out)
    assert closed
    assert wait_for(lambda: job not in server.jobs)
    assert watch.max_take <= wire.MAX_MESSAGE_BYTES


def test_client_of_one_job_cannot_take_a_rank_of_the_honest_job(live):
    server, honest, watch = live
    # It holds the aggregator's secret and knows the job id, but not the job's token.
    for rank in (0, 1):
        with pytest.raises(SparcollError, match="job token"):
            handshake(server.address, honest.job, rank=rank,
                      config=wire.JobConfig(2, 1, 1, 4, 16))
    with pytest.raises(SparcollError, match="job token"):
        handshake(server.address, honest.job, rank=1, config=wire.JobConfig(2, 1, 1, 4, 64))


def test_a_message_whose_body_stalls_after_its_header_is_cut_off(live, monkeypatch):
    """A header, half its body, then nothing, the connection left open (a stopped worker, or a client
    holding the secret): the aggregator held the receive buffer and the job for good. Now it drops the
    connection at BODY_DEADLINE (1 s here) and forgets the job."""
    server, honest, watch = live
    monkeypatch.setattr(server_module, "BODY_DEADLINE", 1.0)
    job = int.from_bytes(os.urandom(8), "little")
    sock = handshake(server.address, job)
    message = contribution(job, range(16), 16)
    sock.sendall(message[:len(message) // 2])
    start, closed = time.monotonic(), False
    try:
        sock.settimeout(10.0)
        closed = sock.recv(1) == b""
    except ConnectionResetError:
        closed = True
    except socket.timeout:          # still open after 10 s
        pass
    finally:
        sock.close()
    assert closed and time.monotonic() - start < 5, time.monotonic() - start
    assert wait_for(lambda: job not in server.jobs), "the job of the stalled connection was kept"


def _connection_of(server, job, rank):
    peer = f"rank {rank} of job {job:#x}"
    assert wait_for(lambda: any(c.peer == peer for c in list(server._connections)), 10)
    return next(c for c in list(server._connections) if c.peer == peer)


def _watch_unsent(server, job, conn, seconds) -> int:
    """The most bytes `conn` had queued unsent while `job` was served (at most `seconds`)."""
    most, deadline = 0, time.monotonic() + seconds
    while job in server.jobs and time.monotonic() < deadline:
        most = max(most, conn.unsent)
        time.sleep(0.005)
    assert job not in server.jobs, f"still served after {seconds} s, {conn.unsent} bytes unsent"
    return most


def test_a_client_that_never_reads_its_results_holds_bounded_memory_and_is_dropped(live, monkeypatch):
    """A job of one rank whose client sends contributions and never reads the results: each completes
    at once, and the aggregator queued its results without bound (3.5 GB in 8.5 s in a review). Now it
    reads the job's next message only while at most SEND_BACKLOG_BYTES (1 MiB here) wait unsent on
    each of its connections, and fails the job once they have waited SLOW_READER_DEADLINE (2 s)."""
    server, honest, watch = live
    monkeypatch.setattr(server_module, "SEND_BACKLOG_BYTES", 1 << 20)
    monkeypatch.setattr(server_module, "SLOW_READER_DEADLINE", 2.0)
    blocks, desc = 256, (256 * 256, 256, 0, 0)     # every result 256 KiB
    job = int.from_bytes(os.urandom(8), "little")
    before = len(watch.records)
    sock = handshake(server.address, job, config=wire.JobConfig(1, 1, 1, 2, blocks))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = np.arange(blocks, dtype=np.int32).tobytes() + np.ones(blocks * 256, np.float32).tobytes()
    sent = [0]

    def attack():
        try:
            for c in range(1, 20_000):
                sock.sendall(header(job, collective=c, count=blocks, progress=blocks, desc=desc) + body)
                sent[0] = c
        except OSError:             # the send timed out (the aggregator stopped reading) or was cut
            pass
    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    try:
        most = _watch_unsent(server, job, _connection_of(server, job, 0), 15)
        assert sent[0] >= 4, sent[0]            # it did fill the queue
        assert most <= (1 << 20) + 2 * blocks * 256 * 4 + 4096, most
        assert any("did not read them: rank 0 of job" in r for r in watch.records[before:]), \
            watch.records[before:][-5:]
    finally:
        sock.close()
        attacker.join(10)
    assert not attacker.is_alive()


def test_a_rank_that_stops_reading_is_not_sent_its_peers_results_without_bound(live, monkeypatch):
    """Rank 1 says in one empty message that it has nothing for the whole tensor, then reads nothing
    and sends nothing more; rank 0 streams contributions and reads its results. Each of rank 0's is
    final at once and goes to rank 1 too: its queue grew without bound, since only a rank's own next
    message waited for its own queue (a review). Now rank 0's waits for rank 1's queue too."""
    server, honest, watch = live
    monkeypatch.setattr(server_module, "SEND_BACKLOG_BYTES", 1 << 20)
    monkeypatch.setattr(server_module, "SLOW_READER_DEADLINE", 2.0)
    blocks, total = 256, 1 << 16
    desc = (total * 256, 256, 0, 0)
    config = wire.JobConfig(2, 1, 1, 2, blocks)
    job = int.from_bytes(os.urandom(8), "little")
    before = len(watch.records)
    reader, silent = handshake(server.address, job, 0, config), handshake(server.address, job, 1, config)
    silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    silent.sendall(contribution(job, [], total, desc=desc))
    data = np.ones(blocks * 256, np.float32).tobytes()
    sent = [0]

    def stream():
        head = bytearray(wire.HEADER_BYTES)
        try:
            for k in range(total // blocks):
                indices = np.arange(k * blocks, (k + 1) * blocks, dtype=np.int32).tobytes()
                reader.sendall(header(job, seq=k, count=blocks, progress=(k + 1) * blocks, desc=desc)
                               + indices + data)
                sent[0] = k + 1
                transport._recv_exact(reader, memoryview(head), "aggregator")
                h = wire.decode_header(head, blocks, job)
                transport._recv_exact(reader, memoryview(bytearray(sum(h.payload_sizes()))), "aggregator")
        except (OSError, SparcollError):    # its result did not come (the aggregator stopped reading)
            pass
    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    try:
        most = _watch_unsent(server, job, _connection_of(server, job, 1), 15)
        assert sent[0] >= 4, sent[0]            # it did fill rank 1's queue
        assert most <= (1 << 20) + 2 * blocks * 256 * 4 + 4096, most
        assert any("did not read them: rank 1 of job" in r for r in watch.records[before:]), \
            watch.records[before:][-5:]
    finally:
        reader.close()
        silent.close()
        streamer.join(10)
    assert not streamer.is_alive()


def test_an_ended_jobs_reason_is_kept_only_as_long_as_a_refusal_carries(live):
    """A job's first rank leaves with a 64 KiB reason: the server remembers the last 1,024 ended
    jobs' reasons for their latecomers, and kept each whole (64 MiB at most, for good) although a
    refusal carries only MAX_REASON_BYTES of it."""
    server, honest, watch = live
    job = int.from_bytes(os.urandom(8), "little")
    sock = handshake(server.address, job)
    _, closed = send_and_drain(sock, wire.bye_message(job, (wire.ErrorCode.PEER, "x" * (1 << 16))))
    assert closed
    assert wait_for(lambda: job not in server.jobs)
    assert job in server._ended and len(server._ended[job]) <= wire.MAX_REASON_BYTES, len(server._ended.get(job, ""))
    with pytest.raises(SparcollError, match="xxx"):
        handshake(server.address, job, rank=1)


def test_leaks_and_memory_after_the_attacks(live):
    server, honest, watch = live
    assert wait_for(lambda: only_honest_left(server, honest), 10), (set(server.jobs),
                                                                     len(server._connections))
    assert watch.max_take <= wire.MAX_MESSAGE_BYTES
    assert not watch.thread_errors, watch.thread_errors
    assert honest.errors == [] and honest.done > 0
