"""Authentication and isolation: who may connect to an aggregator, and what a connected client may touch.

Every connection starts with the HMAC-SHA256 handshake of wire.py (both nonces, the role and every HELLO
field are MACed with the secret: the job's secret from the Store for a colocated aggregator, the shared
SPARCOLL_SECRET / --secret-file one for a dedicated aggregator). Clients with a wrong, empty or another
job's secret, replayed or reflected proofs, silent clients and clients of another job are refused with
AuthenticationError (or a timeout) and dropped before any job state exists for them, while an honest
job on the same aggregator keeps producing exact results.
"""
from __future__ import annotations

import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from sparcoll import cli, server as server_module, transport, wire
from sparcoll.communicator import Communicator
from sparcoll.errors import AuthenticationError, CollectiveTimeout, MismatchError, ProtocolError
from sparcoll.secret import shared_secret
from support import on_threads, sparcoll_here, start_aggregator, stop, wait_for

CFG = wire.JobConfig(world=2, num_aggs=2, streams=1, credits=4, message_blocks=2048)


class ColocatedJob:
    """Two in-process ranks with colocated aggregators; rank 0's aggregator is the one attacked."""

    def __init__(self, prefix: str, store=None, **options):
        self.store = store or dist.HashStore()
        self.comms: list[Communicator | None] = [None, None]

        def make(rank):
            self.comms[rank] = Communicator(dist.PrefixStore(prefix, self.store), rank, 2,
                                            timeout=10.0, **options)
        on_threads(make, 2)
        blob = dist.PrefixStore(prefix, self.store).get("1/job")     # the first communicator there
        self.job, self.secret = int.from_bytes(blob[:8], "little"), blob[8:]
        self.server = self.comms[0]._worker.server
        self.address = self.server.address
        self.config = self.comms[0].config

    def check_exact(self, k: int = 0) -> None:
        xs = [torch.arange(5000, dtype=torch.float32) * (r + 1 + k) for r in range(2)]
        on_threads(lambda rank: self.comms[rank].allreduce(xs[rank]), 2)
        want = torch.arange(5000, dtype=torch.float32) * (3 + 2 * k)
        assert all(torch.equal(x, want) for x in xs)

    def close(self):
        for comm in self.comms:
            if comm is not None:
                comm.close()


@pytest.fixture
def job_pair(store):
    a, b = ColocatedJob("a/", store), ColocatedJob("b/", store)
    yield a, b
    a.close()
    b.close()


def hello_for(job: int, rank: int = 1, config=CFG, agg_index: int = 0) -> wire.Hello:
    return wire.Hello(job, rank, agg_index, config, os.urandom(wire.NONCE_BYTES))


@pytest.mark.parametrize("rank, agg_index", [(2, 0), (0, 2), (7, 0)])
def test_a_hello_naming_a_rank_or_aggregator_outside_its_job_is_refused(rank, agg_index):
    """rank == world and agg_index == num_aggs are the boundaries random bytes never hit."""
    with pytest.raises(ProtocolError, match=f"rank {rank} of 2, aggregator {agg_index} of 2"):
        wire.Hello.decode(hello_for(5, rank, agg_index=agg_index).encode())
    assert wire.Hello.decode(hello_for(5, 1, agg_index=1).encode()).rank == 1


def refused(address: str, hello: wire.Hello, secret: bytes, error=AuthenticationError) -> str:
    with pytest.raises(error) as info:
        transport.connect(address, hello, secret, 5.0, wire.job_token(secret))
    return str(info.value)


def state_of(server) -> tuple:
    return set(server.jobs), len(server._connections)


def test_wrong_empty_and_other_jobs_secret_are_refused(job_pair, caplog):
    a, b = job_pair
    a.check_exact(0)
    before = state_of(a.server)
    caplog.set_level(logging.WARNING, logger="sparcoll.aggregator")
    for secret in (b"wrong", b"", b.secret, a.secret[:-1], a.secret + b"x"):
        text = refused(a.address, hello_for(a.job, config=a.config), secret)
        assert "failed authentication" in text and a.address in text, text
    # job B's own client (its id, its secret) at job A's aggregator: refused too
    refused(a.address, hello_for(b.job, config=b.config), b.secret)
    assert wait_for(lambda: state_of(a.server) == before)
    # Every refusal is counted; the log gets one line per 10 s (a flood must not flood it).
    assert wait_for(lambda: a.server.refused.count == 6)
    assert any("refused a connection" in r.getMessage() for r in caplog.records)
    a.check_exact(1)
    b.check_exact(1)


def test_right_secret_but_wrong_job_or_taken_rank_or_other_config(job_pair):
    a, _ = job_pair
    before = state_of(a.server)
    assert "serves job" in refused(a.address, hello_for(a.job ^ 1, config=a.config), a.secret)
    assert "already connected" in refused(a.address, hello_for(a.job, config=a.config), a.secret)
    other = wire.JobConfig(2, 2, 1, 4, 64)
    # Options that disagree with the job's are the caller's mismatch, not an authentication failure.
    assert "joins job" in refused(a.address, hello_for(a.job, config=other), a.secret,
                                  MismatchError)
    assert "aggregator 1" in refused(a.address, hello_for(a.job, config=a.config, agg_index=1),
                                     a.secret, MismatchError)
    assert state_of(a.server) == before
    a.check_exact(2)


def raw_handshake_start(address: str, hello: wire.Hello) -> tuple[socket.socket, bytes, bytes]:
    host, port = transport.parse_address(address)
    sock = socket.create_connection((host, port), timeout=5)
    sock.sendall(hello.encode())
    buf = bytearray(wire.CHALLENGE_BYTES)
    transport._recv_exact(sock, memoryview(buf), "server")
    nonce, server_mac = wire.decode_challenge(buf)
    return sock, nonce, server_mac


def verdict_then_eof(sock: socket.socket) -> str:
    buf = bytearray(wire.VERDICT_BYTES)
    transport._recv_exact(sock, memoryview(buf), "server")
    reason = bytearray(wire.decode_verdict(buf)[1])
    transport._recv_exact(sock, memoryview(reason), "server")
    assert sock.recv(1) == b"", "the server kept a refused connection open"
    sock.close()
    return reason.decode()


def test_replayed_and_reflected_proofs_are_refused(job_pair):
    """An eavesdropper who recorded a valid handshake cannot replay it (the server's nonce changes),
    and the server's own MAC is no proof (the role is MACed)."""
    a, _ = job_pair
    server = server_module.AggregatorServer("127.0.0.1", 0, a.secret, only_job=a.job)
    try:
        hello = hello_for(a.job, rank=1, config=a.config)
        sock, nonce, _ = raw_handshake_start(server.address, hello)
        recorded = wire.encode_proof(wire.mac(a.secret, b"client", hello, nonce))
        sock.sendall(recorded)
        buf = bytearray(wire.VERDICT_BYTES)
        transport._recv_exact(sock, memoryview(buf), "server")
        assert wire.decode_verdict(buf)[1] == 0              # the genuine run is welcome
        sock.sendall(wire.bye_message(a.job))
        sock.close()
        assert wait_for(lambda: not server.jobs[a.job].workers)
        for _ in range(3):                                   # replay HELLO + PROOF verbatim
            sock, _, _ = raw_handshake_start(server.address, hello)
            sock.sendall(recorded)
            assert verdict_then_eof(sock) == "authentication failed"
        sock, _, server_mac = raw_handshake_start(server.address, hello_for(a.job, config=a.config))
        sock.sendall(wire.encode_proof(server_mac))          # reflect the server's MAC
        assert verdict_then_eof(sock) == "authentication failed"
        assert wait_for(lambda: not server.jobs[a.job].workers and not server._connections)
    finally:
        server.close()


def test_silent_client_is_dropped_and_silent_server_times_out(monkeypatch):
    # Both sides keep their handshake deadline (not the defaults); the bounds, 10x the deadlines,
    # leave room for a loaded machine.
    handshake_timeout, connect_timeout = 0.5, 1.0
    monkeypatch.setattr(server_module, "HANDSHAKE_TIMEOUT", handshake_timeout)
    server = server_module.AggregatorServer("127.0.0.1", 0, b"s")
    try:
        host, port = transport.parse_address(server.address)
        sock = socket.create_connection((host, port), timeout=5)
        sock.sendall(b"SPCL")                                # a few bytes, then nothing
        t = time.monotonic()
        sock.settimeout(20 * handshake_timeout)
        assert sock.recv(100) == b"" and time.monotonic() - t < 10 * handshake_timeout
        sock.close()
    finally:
        server.close()
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        address = "127.0.0.1:%d" % silent.getsockname()[1]
        t = time.monotonic()
        with pytest.raises(CollectiveTimeout, match="timed out"):
            transport.connect(address, hello_for(1), b"s", connect_timeout)
        assert time.monotonic() - t < 10 * connect_timeout
    finally:
        silent.close()


# ---- dedicated aggregators: the shared secret --------------------------------------------------
SHARED = "shared-secret-0123456789"     # shared_secret() refuses fewer than 16 bytes


class secret_env:
    """SPARCOLL_SECRET set (or unset, with None) for the duration of a block."""

    def __init__(self, secret: str | None):
        self.secret = secret

    def __enter__(self):
        self.saved = os.environ.pop("SPARCOLL_SECRET", None)
        if self.secret is not None:
            os.environ["SPARCOLL_SECRET"] = self.secret

    def __exit__(self, *exc):
        os.environ.pop("SPARCOLL_SECRET", None)
        if self.saved is not None:
            os.environ["SPARCOLL_SECRET"] = self.saved


def dedicated_init(address: str, secret: str | None, store=None, world=1, rank=0, prefix="d/"):
    with secret_env(secret):
        return Communicator(dist.PrefixStore(prefix, store or dist.HashStore()), rank, world,
                            aggregators=[address], timeout=5.0)


def test_dedicated_aggregator_refuses_workers_without_its_secret(caplog):
    caplog.set_level(logging.WARNING, logger="sparcoll.aggregator")
    server = server_module.AggregatorServer("127.0.0.1", 0, SHARED.encode())
    try:
        for secret in ("a-wrong-secret-of-32-characters!", "", None):
            t = time.monotonic()
            with pytest.raises(AuthenticationError, match=server.address):
                dedicated_init(server.address, secret)
            assert time.monotonic() - t < 5
        # the worker leaves once this server's proof fails its check: the log says why it may have
        assert wait_for(lambda: any("its secret differs (or it has none)" in r.getMessage() for r in caplog.records))
        assert not server.jobs and not server._connections
        with dedicated_init(server.address, SHARED) as comm:
            x = torch.ones(3000)
            comm.allreduce(x)
            assert torch.equal(x, torch.ones(3000))
    finally:
        server.close()


def test_client_of_job_a_cannot_touch_job_b_through_its_own_connection(store):
    """A client admitted to job A that writes messages naming job B is cut off by the header check,
    told why."""
    server = server_module.AggregatorServer("127.0.0.1", 0, SHARED.encode())
    try:
        comms = [None, None]

        def make(rank):
            comms[rank] = Communicator(dist.PrefixStore("b/", store), rank, 2,
                                       aggregators=[server.address], timeout=5.0)
        with secret_env(SHARED):
            on_threads(make, 2)
        job_b = comms[0].job
        job_a = job_b ^ 0xFF
        sock = transport.connect(server.address, hello_for(job_a, rank=0,
                                                           config=comms[0].config),
                                 SHARED.encode(), 5.0)
        header = wire.data_header(wire.Kind.CONTRIBUTE, stream=0, job=job_b, collective=1, seq=0,
                                  count=0, progress=1, descriptor=(1000, 256, 0, 0))
        sock.sendall(header)
        sock.settimeout(5)
        got = b""
        while chunk := sock.recv(4096):             # dropped, after it was told why
            got += chunk
        sock.close()
        told = wire.decode_header(got[:wire.HEADER_BYTES], 64, job_a)
        assert told.kind is wire.Kind.ERROR and told.collective == wire.CONNECTION, told
        assert got[wire.HEADER_BYTES:].decode().startswith("rank 0 sent a malformed message"), got
        assert f"on a connection of job {job_a:#x}" in got[wire.HEADER_BYTES:].decode(), got
        assert wait_for(lambda: job_a not in server.jobs)
        xs = [torch.full((1000,), float(r + 1)) for r in range(2)]
        on_threads(lambda r: comms[r].allreduce(xs[r]), 2)
        assert all(torch.equal(x, torch.full((1000,), 3.0)) for x in xs)
        for comm in comms:
            comm.close()
    finally:
        server.close()


def test_secret_holder_cannot_join_a_free_rank_of_another_job():
    """Every job shares a dedicated aggregator's secret, so that secret cannot tell jobs apart: the job
    token (derived from the job's own Store secret) does. An intruder that knows the aggregator secret,
    job B's id and configuration, but not B's Store secret, is refused the free rank of B."""
    server = server_module.AggregatorServer("127.0.0.1", 0, b"k")
    try:
        # job B has world 2; only its rank 0 has connected so far
        job_b = 0x1234_5678_9ABC_DEF0
        config = wire.JobConfig(2, 1, 1, 4, 2048)
        token_b = wire.job_token(b"job B's store secret")
        honest = transport.connect(server.address, hello_for(job_b, rank=0, config=config), b"k", 5,
                                   token_b)
        try:
            with pytest.raises(AuthenticationError, match="job token"):
                intruder = transport.connect(server.address, hello_for(job_b, rank=1, config=config),
                                             b"k", 5, wire.job_token(b"a guess"))
                intruder.close()
            rank1 = transport.connect(server.address, hello_for(job_b, rank=1, config=config),
                                      b"k", 5, token_b)      # B's real rank 1 still gets in
            rank1.close()
        finally:
            honest.close()
    finally:
        server.close()


# ---- the command line ----------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10", "10.1.2.3", "example.org", ""])
def test_cli_refuses_non_loopback_without_a_secret(host, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("SPARCOLL_SECRET", raising=False)
    refused = sparcoll_here(capsys, ["aggregator", "--host", host, "--port", "0"], 30)   # not served
    assert refused.returncode == 2 and "refusing to listen" in refused.stderr, refused.stderr
    empty = tmp_path / "empty"
    empty.write_bytes(b"  \n")                       # a secret file holding only whitespace
    assert sparcoll_here(capsys, ["aggregator", "--host", host, "--secret-file", empty], 30).returncode == 2


def test_cli_refuses_through_the_real_entry_point():
    env = {k: v for k, v in os.environ.items() if k != "SPARCOLL_SECRET"}
    proc = subprocess.run([sys.executable, "-m", "sparcoll", "aggregator", "--host", "0.0.0.0"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "refusing to listen on 0.0.0.0" in proc.stderr


def test_cli_on_loopback_with_a_secret_file(tmp_path):
    """Default host is loopback; the secret comes from the file; a wrong secret is refused."""
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(b" file-secret-0123456789\n")      # stripped
    env = {k: v for k, v in os.environ.items() if k != "SPARCOLL_SECRET"}
    proc, address = start_aggregator("--secret-file", str(secret_file), env=env)
    try:
        assert address.startswith("127.0.0.1:"), address
        assert "failed authentication" in refused(address, hello_for(5, rank=0), b"wrong")
        sock = transport.connect(address, hello_for(5, rank=0), b"file-secret-0123456789", 5.0)
        sock.sendall(wire.bye_message(5))
        sock.close()
    finally:
        stop(proc)


GOOD = "0123456789abcdef0123"     # 20 bytes
SECRET_CASES = [    # what the variable or the file holds -> the secret, or the error's text
    (" " + GOOD + "\n", GOOD.encode()),
    ("\t\n  ", "holds no secret"),
    ("short-secret", "holds a secret of 12 bytes"),
    (" " + GOOD[:15] + "\n", "holds a secret of 15 bytes"),
]


@pytest.mark.parametrize("raw, expected", SECRET_CASES)
@pytest.mark.parametrize("source", ["env", "file"])
def test_shared_secret_is_stripped_and_refused_when_blank_or_short(source, raw, expected,
                                                                   monkeypatch, tmp_path):
    """The same rules for $SPARCOLL_SECRET and a secret file: surrounding whitespace is stripped; a
    secret of fewer than 16 bytes (whitespace only included) is a ValueError naming its source and
    how to make a good one."""
    monkeypatch.delenv("SPARCOLL_SECRET", raising=False)
    if source == "env":
        monkeypatch.setenv("SPARCOLL_SECRET", raw)
        path, where = None, "$SPARCOLL_SECRET"
    else:
        path = str(tmp_path / "secret")
        with open(path, "w") as f:
            f.write(raw)
        where = f"the secret file {path}"
    if isinstance(expected, bytes):
        assert shared_secret(path) == expected
    else:
        with pytest.raises(ValueError) as info:
            shared_secret(path)
        text = str(info.value)
        assert text.startswith(f"{where} {expected}") and "secrets.token_hex(32)" in text, text


def test_no_shared_secret_and_unusable_secret_files(monkeypatch, tmp_path):
    """An unset or empty variable means no secret (loopback only); a file named but empty or
    unreadable is an error."""
    monkeypatch.delenv("SPARCOLL_SECRET", raising=False)
    assert shared_secret() == b""
    monkeypatch.setenv("SPARCOLL_SECRET", "")
    assert shared_secret() == b""
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.* holds no secret"):
        shared_secret(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="cannot read the secret file .*missing"):
        shared_secret(str(tmp_path / "missing"))


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
@pytest.mark.parametrize("secret", ["   \n", "short-secret"])
@pytest.mark.parametrize("source", ["env", "file"])
def test_cli_refuses_blank_or_short_secrets(host, secret, source, capsys, monkeypatch, tmp_path):
    """On loopback too: a secret that was given but is unusable is an error, not "no secret"."""
    monkeypatch.delenv("SPARCOLL_SECRET", raising=False)
    args = ["aggregator", "--host", host, "--port", "0"]
    if source == "env":
        monkeypatch.setenv("SPARCOLL_SECRET", secret)
    else:
        (tmp_path / "secret").write_text(secret)
        args += ["--secret-file", str(tmp_path / "secret")]
    # On a thread with a deadline: a CLI that accepted the secret would serve until signalled.
    code = []
    runner = threading.Thread(target=lambda: code.append(cli.main(args)), daemon=True)
    runner.start()
    runner.join(60)
    assert code == [2]
    err = capsys.readouterr().err
    assert err.startswith("sparcoll aggregator: ") and "at least 16 bytes" in err, err


def test_colocated_aggregators_bind_loopback_by_default(monkeypatch):
    monkeypatch.delenv("SPARCOLL_HOST", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    job = ColocatedJob("lo/")
    try:
        for comm in job.comms:
            host = comm._worker.server.sock.getsockname()[0]
            assert host == "127.0.0.1", host
    finally:
        job.close()


def at_eof(sock: socket.socket) -> bool:
    """Whether the peer has closed `sock` (without waiting, and without consuming data)."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except ConnectionResetError:
        return True


def test_a_rank_is_taken_from_its_admission_so_a_second_connection_is_refused(monkeypatch):
    """A client claims (job, rank) while another connection of that rank is admitted but not yet
    attached (held here before attachment): the second is refused at its handshake, saying why;
    the first is then attached, and the job, which had no attached worker, was kept for it."""
    attend = server_module.AggregatorServer._attend
    admitted, release = threading.Event(), threading.Event()

    def held(self, sock, hello):
        admitted.set()
        release.wait(10)
        return attend(self, sock, hello)

    monkeypatch.setattr(server_module.AggregatorServer, "_attend", held)
    server = server_module.AggregatorServer("127.0.0.1", 0, b"k")
    first = None
    try:
        hello = hello_for(77, rank=1, config=wire.JobConfig(2, 1, 1, 4, 2048))
        first = transport.connect(server.address, hello, b"k", 5.0, wire.job_token(b"k"))
        assert admitted.wait(10)
        assert "rank 1 of job 0x4d is already connected" in refused(server.address, hello, b"k")
        assert not server.jobs[77].workers and server.jobs[77].arriving == {1}
        release.set()
        assert wait_for(lambda: 1 in server.jobs[77].workers, 10)
        assert not at_eof(first) and len(server._connections) == 1
    finally:
        release.set()
        if first is not None:
            first.close()
        server.close()


def test_both_ends_of_a_connection_probe_a_silent_peer_with_tcp_keepalive():
    """A worker whose host lost power sends no FIN: a dedicated aggregator's receive for it had no
    deadline, and its thread and job stayed for good. Both ends now keep TCP alive, and a peer that
    answers no probe ends the connection after about two minutes (60 s idle, 6 probes 10 s apart)."""
    server = server_module.AggregatorServer("127.0.0.1", 0, b"k" * 16)
    sock = None
    try:
        sock = transport.connect(server.address, hello_for(41, rank=0), b"k" * 16, 5.0, wire.job_token(b"k" * 16))
        assert wait_for(lambda: len(server._serving) == 1)
        for end in (sock, *server._serving.values()):
            assert end.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert [end.getsockopt(socket.IPPROTO_TCP, opt) for opt in
                    (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT)] == [60, 10, 6]
            # no probe goes while data waits for an ack (results to a vanished or stalled peer)
            assert end.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 120_000
    finally:
        if sock is not None:
            sock.close()
        server.close()


class NewerHello(wire.Hello):
    """A HELLO of the next protocol version, as a client upgraded before its aggregator sends it."""

    def encode(self) -> bytes:
        raw = bytearray(super().encode())
        raw[len(wire.MAGIC)] = wire.VERSION + 1
        return bytes(raw)


def test_a_hello_the_aggregator_cannot_read_is_refused_with_its_reason_on_the_client():
    """The aggregator answers a HELLO it cannot read (another version, limits out of range) with its
    verdict where the client reads the challenge: the client said "closed the connection", the
    reason only in the aggregator's log (a review)."""
    server = server_module.AggregatorServer("127.0.0.1", 0, b"k" * 16)
    try:
        newer = NewerHello(41, 1, 0, CFG, os.urandom(wire.NONCE_BYTES))
        assert f"refused the connection: unsupported protocol version {wire.VERSION + 1} (this is {wire.VERSION})" \
            in refused(server.address, newer, b"k" * 16)
        wide = hello_for(42, config=wire.JobConfig(world=2, num_aggs=2, streams=65, credits=4, message_blocks=2048))
        assert "refused the connection: hello with streams=65 outside [1, 64]" in refused(server.address, wide,
                                                                                           b"k" * 16)
    finally:
        server.close()


def test_a_refusal_longer_than_a_challenge_is_read_whole_and_a_wrong_secret_still_says_so():
    """A reason longer than the challenge the client reads in its place used to fail the challenge's
    MAC: "wrong secret?". A server that sends it (played here), then one with another secret."""
    reason = "x" * 200
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def refuse():
            sock, _ = listener.accept()
            with sock:
                sock.recv(wire.HELLO_BYTES)
                sock.sendall(wire.encode_verdict(reason))
        thread = threading.Thread(target=refuse, daemon=True)
        thread.start()
        address = transport.format_address("127.0.0.1", listener.getsockname()[1])
        assert f"refused the connection: {reason}" in refused(address, hello_for(43), b"k" * 16)
        thread.join(10)
    server = server_module.AggregatorServer("127.0.0.1", 0, b"k" * 16)
    try:
        assert "wrong secret" in refused(server.address, hello_for(44), b"w" * 16)
        # a worker without one (dedicated aggregators, $SPARCOLL_SECRET unset) is told so (a review)
        assert "(this rank has no secret: set $SPARCOLL_SECRET to the aggregator's)" in refused(
            server.address, hello_for(45), b"")
    finally:
        server.close()
