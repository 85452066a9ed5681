"""Fault injection with real processes: SIGKILL a worker or a dedicated aggregator at chosen points.

Every episode is one small job: worker processes (and dedicated aggregator processes) forked from a fork
server that has torch and sparcoll imported already (12 ms a process instead of 1.4 s), rendezvous through
a TCPStore the test hosts, each reporting through its own pipe. The victim kills itself with SIGKILL at
a deterministic point, chosen by a hook the test installs inside the victim (a counter wrapped around a
transport, aggregator or scan function; the worker side is never modified), by a timer, or by the test
between two collectives. The survivors report what they raised, how long it took, whether every finished
collective was exact, what a later call raised, and how long close() took. Episodes run a few at a time;
every wait is bounded and every process is killed in the end.

Mismatch and poisoning tests at the end run in-process (Communicators in threads over a HashStore).
"""
from __future__ import annotations

import functools
import multiprocessing.connection as mp_connection
import os
import random
import re
import signal
import socket
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import sparcoll
from sparcoll import aggregator as aggregator_module, server as server_module, wire
from sparcoll.communicator import Communicator
from sparcoll.errors import REPORT_GRACE
from ranks import fork_context, fork_process, run_ranks
from support import error_chain, join_all, on_threads, outcome_of, start_aggregator, stop, wait_for

NUMEL = 1 << 19            # 2048 blocks of 256 floats
TIMEOUT = 5.0              # init(timeout=...) of every worker
SLACK = 4.0                # scheduling slack on 2 shared cores, on top of the deadline
CLOSE_LIMIT = 8.0          # close() must return within this
AT_ONCE = REPORT_GRACE + 1.5   # a poisoned call raises "at once": after the grace a lost connection
                               # gives a peer's report (0.5 s), with slack for a busy machine
OPTIONS = dict(message_blocks=8, credits=2, timeout=TIMEOUT)   # many messages per collective
EPISODE_LIMIT = 45.0       # hard bound of one episode; processes are killed after it
KILL_POINT_NOT_REACHED = 86  # exit status of a victim that ran to its end
PARALLEL = 4               # episodes at a time (most of an episode is waiting)
SURVIVOR_ERRORS = {"PeerError", "CollectiveTimeout", "PoisonedError", "ProtocolError",
                   "AuthenticationError"}

# Held to start a child and to read a child's status. Process.start() first polls every earlier
# child (multiprocessing's _cleanup), and a fork-server child's status is one read from a pipe: two
# threads polling one child at once (an episode joining its aggregator while another episode starts a
# worker) left one of them "exit code 255" (status unreadable) for a victim that died at its kill point,
# twice in full test runs.
_STATUS_LOCK = threading.Lock()


def _start(p) -> None:
    with _STATUS_LOCK:
        p.start()


def _exitcode(p, timeout: float) -> int | None:
    """p's exit code once it has ended, waiting up to `timeout` (None: still running); the wait
    outside _STATUS_LOCK, the read of the status under it."""
    mp_connection.wait([p.sentinel], timeout)
    with _STATUS_LOCK:
        return p.exitcode


# ---- inputs ------------------------------------------------------------------------------------
def make_input(k: int, rank: int, numel: int = NUMEL) -> torch.Tensor:
    """Small integers (exact sums) in about half of the blocks, a different pattern per (k, rank)."""
    g = torch.Generator().manual_seed(1000 * k + rank)
    nblocks = -(-numel // 256)
    x = torch.randint(-4, 5, (nblocks, 256), generator=g).float()
    x[torch.rand(nblocks, generator=g) < 0.5] = 0.0
    return x.view(-1)[:numel].clone()


def expected(k: int, world: int, numel: int = NUMEL) -> torch.Tensor:
    return sum(make_input(k, r, numel) for r in range(world))


# ---- what runs inside the victim -----------------------------------------------------------------
def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def _counter(n: int):
    """A thread-safe 'is this the n-th call?'."""
    lock = threading.Lock()
    state = [0]

    def hit() -> bool:
        with lock:
            state[0] += 1
            return state[0] == n
    return hit


def _kind(buffers) -> int:
    return bytes(memoryview(buffers[0]).cast("B")[5:6])[0]


def _die_before(owner, name: str, hit) -> None:
    """Wrap function or method `name` of `owner` (a module or a class): the process dies as it is
    called, when hit()."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if hit():
            die()
        return original(*args, **kwargs)
    setattr(owner, name, wrapper)


def install_kill(point: str, n: int = 1, own_rank: int | None = None, delay: float = 0.0) -> None:
    """Make this process SIGKILL itself at `point`, the n-th time it is reached."""
    from sparcoll import aggregator, collective, transport, wire

    hit = _counter(n)
    if point == "connect":                  # about to connect to an aggregator (init)
        _die_before(transport, "connect", hit)
    elif point == "proof":                  # got the aggregator's challenge, proof not sent (init)
        _die_before(wire, "encode_proof", hit)
    elif point == "accept":                 # server side of the n-th handshake
        _die_before(transport, "accept", hit)
    elif point == "scan":                   # the engine scans the tensor of the n-th collective
        class KillingBlockTensor(collective.BlockTensor):
            def nonzero(self, lo=0, hi=None):   # ranges are scanned one by one: count the first
                if lo == 0 and hit():
                    die()
                return super().nonzero(lo, hi)
        collective.BlockTensor = KillingBlockTensor
    elif point == "send":                   # the n-th contribution is about to be queued
        original_send = transport.Connection.send

        def send(self, buffers, blocks=0, lease=None):
            if _kind(buffers) == wire.Kind.CONTRIBUTE and hit():
                die()
            return original_send(self, buffers, blocks, lease)
        transport.Connection.send = send
    elif point.startswith("partial"):       # the n-th contribution is half written to the socket
        fraction = {"partial-header": 20, "partial-payload": None}[point]
        original_sendmsg = transport.sendmsg_all

        def sendmsg_all(sock, buffers, *flags):
            if _kind(buffers) == wire.Kind.CONTRIBUTE and hit():
                raw = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
                cut = fraction if fraction is not None else wire.HEADER_BYTES + (len(raw) - wire.HEADER_BYTES) // 2
                sock.sendall(raw[:cut])
                time.sleep(0.05)
                die()
            return original_sendmsg(sock, buffers, *flags)
        transport.sendmsg_all = sendmsg_all
    elif point == "agg-contribute":         # this process's aggregator got a peer's n-th contribution
        original_contribute = aggregator.AggregatorJob.contribute

        def contribute(self, rank, *args, **kwargs):
            if rank != own_rank and hit():
                die()
            return original_contribute(self, rank, *args, **kwargs)
        aggregator.AggregatorJob.contribute = contribute
    elif point == "agg-broadcast":          # this process's aggregator is about to send its n-th result
        _die_before(aggregator.AggregatorJob, "_broadcast", hit)
    elif point == "recv-result":            # the worker read the header of its n-th remote result
        original_recv = transport.Connection.recv_header

        def recv_header(self, *args):
            h = original_recv(self, *args)
            if h.kind is wire.Kind.RESULT and hit():
                die()
            return h
        transport.Connection.recv_header = recv_header
    elif point == "close":                  # inside Communicator.close(), after the BYE was queued
        original_close = transport.Connection.close

        def close(self, *args):
            if hit():
                time.sleep(0.02)
                die()
            return original_close(self, *args)
        transport.Connection.close = close
    elif point == "ring-data":              # the n-th ring allreduce of the data has just started
        from sparcoll import ring
        original_data = ring.Ring._allreduce_data

        def allreduce_data(self, *args):
            work = original_data(self, *args)
            if hit():
                time.sleep(0.002)           # let gloo's threads send part of it
                die()
            return work
        ring.Ring._allreduce_data = allreduce_data
    elif point == "ring-check":             # about to send its row of the n-th check round
        from sparcoll import star
        _die_before(star.Star, "round", hit)
    elif point == "timer":
        threading.Timer(delay, die).start()
    elif point in ("now", "between", "after-init", "none"):
        pass                                # handled by the worker loop
    else:
        raise ValueError(point)


# ---- child processes -----------------------------------------------------------------------------
def run_worker(rank: int, world: int, store, spec: dict) -> dict:
    """One rank of an episode: init, a series of exact-checked collectives, then close."""
    opts = dict(OPTIONS, **spec.get("options", {}))
    victim = rank in spec.get("victims", ())
    kill = spec.get("kill", ("none", 0))
    collectives = spec.get("collectives", 6)
    if victim and kill[0] == "close":
        collectives = spec.get("victim_collectives", collectives)
    res = dict(rank=rank, completed=0, error=None, msg="", error_s=None, then=None, then_s=None,
               close_s=None, exact=True, step="init")
    comm = None
    started = time.monotonic()
    t = time.monotonic()
    try:
        if victim and kill[0] == "now":
            die()
        comm = Communicator(dist.PrefixStore("c1/", store), rank, world, **opts)
        if victim and kill[0] in ("timer", "after-init"):
            install_kill("timer", delay=kill[1] if kill[0] == "timer" else 0.0)
        res["step"] = "collectives"
        k = 0
        while k < collectives and time.monotonic() - started < 20:
            if k in spec.get("pause_before", ()):
                store.set(f"paused/{k}/{rank}", "1")
                store.wait([f"go/{k}"], timedelta(seconds=30))
            if victim and kill[0] == "between" and kill[1] == k:
                die()
            x = make_input(k, rank)
            t = time.monotonic()
            if spec.get("async"):
                works = [comm.allreduce(make_input(k + i, rank), async_op=True)
                         for i in range(spec["async"])]
                for i, work in enumerate(works):
                    t = time.monotonic()
                    try:
                        got = work.wait(timeout=3 * TIMEOUT)
                    except sparcoll.SparcollError as exc:
                        res.setdefault("async_errors", []).append(
                            (type(exc).__name__, time.monotonic() - t))
                        if res["error"] is None:
                            res.update(error=type(exc).__name__, msg=error_chain(exc),
                                       error_s=time.monotonic() - t)
                        continue
                    res["exact"] &= torch.equal(got, expected(k + i, world))
                    res["completed"] += 1
                if res["error"] is not None:
                    raise _Done()
                k += spec["async"]
                continue
            comm.allreduce(x)
            res["exact"] &= torch.equal(x, expected(k, world))
            res["completed"] += 1
            k += 1
    except _Done:
        pass
    except sparcoll.SparcollError as exc:
        res.update(error=type(exc).__name__, msg=error_chain(exc), error_s=time.monotonic() - t)
    except BaseException:
        res.update(error="UNEXPECTED", msg=traceback.format_exc())
    if res["error"] is not None and comm is not None:
        t = time.monotonic()            # a failed communicator is poisoned: later calls raise at once
        try:
            comm.allreduce(torch.ones(300))
            res["then"] = "NO ERROR"
        except sparcoll.SparcollError as exc:
            res["then"] = type(exc).__name__
        except BaseException as exc:
            res["then"] = f"UNEXPECTED {type(exc).__name__}: {exc}"
        res["then_s"] = time.monotonic() - t
    if comm is not None:
        t = time.monotonic()
        comm.close()
        res["close_s"] = time.monotonic() - t
    res["kill point not reached"] = victim     # a victim that gets here must not pass for one killed
    return res


class _Done(Exception):
    pass


def _worker_child(rank, world, port, conn, spec):
    try:
        torch.set_num_threads(1)
        for key, value in spec.get("env", {}).items():
            os.environ[key] = value
        if rank in spec.get("victims", ()) and spec["kill"][0] not in (
                "now", "between", "after-init", "timer", "none"):
            install_kill(spec["kill"][0], spec["kill"][1], own_rank=rank)
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30))
        result = run_worker(rank, world, store, spec)
    except BaseException:
        result = dict(rank=rank, error="HARNESS", msg=traceback.format_exc())
    conn.send(result)
    conn.close()
    if result.get("kill point not reached"):
        os._exit(KILL_POINT_NOT_REACHED)


def _aggregator_child(conn, spec):
    """A dedicated aggregator (the same server `sparcoll aggregator` runs), maybe with a kill hook."""
    try:
        torch.set_num_threads(1)
        if spec.get("kill"):
            install_kill(*spec["kill"])
        server = server_module.AggregatorServer("127.0.0.1", 0, spec.get("secret", b""))
        conn.send(server.address)
    except BaseException:
        conn.send("HARNESS " + traceback.format_exc())
    time.sleep(EPISODE_LIMIT + 30)      # killed by the test long before
    os._exit(0)


# ---- the episode runner (parent side) ------------------------------------------------------------
def run_episode(spec: dict) -> dict:
    """Run one job; return {"workers": {rank: result or None}, "exitcodes": {...}, "aggs": [...]}."""
    ctx = fork_context()
    world = spec.get("world", 2)
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    procs, agg_procs, pipes, out = {}, [], {}, {"workers": {}, "exitcodes": {}, "aggs": []}
    deadline = time.monotonic() + EPISODE_LIMIT
    try:
        spec = dict(spec)
        agg_specs = spec.get("aggregators", [])
        addresses = []
        for agg_spec in agg_specs:
            r, w = ctx.Pipe(duplex=False)
            p = fork_process(_aggregator_child, w, agg_spec)
            _start(p)
            w.close()
            if not r.poll(30):
                raise AssertionError("dedicated aggregator did not start")
            address = r.recv()
            assert not address.startswith("HARNESS"), address
            agg_procs.append(p)
            addresses.append(address)
        out["aggs"] = addresses
        if addresses:
            spec["options"] = dict(spec.get("options", {}), aggregators=addresses)
        if spec.get("kill_aggregator_first"):
            agg_procs[0].kill()
            _exitcode(agg_procs[0], 10)
        for rank in range(world):
            r, w = ctx.Pipe(duplex=False)
            p = fork_process(_worker_child, rank, world, store.port, w, spec)
            _start(p)
            w.close()
            procs[rank], pipes[rank] = p, r
        if "parent_kill" in spec:       # the test kills a process while every worker is paused
            target, k = spec["parent_kill"]
            store.wait([f"paused/{k}/{r}" for r in range(world)], timedelta(seconds=30))
            victim_proc = agg_procs[0] if target == "aggregator" else procs[target]
            victim_proc.kill()
            _exitcode(victim_proc, 10)
            time.sleep(0.2)             # let the survivors notice, as they would between steps
            store.set(f"go/{k}", "1")
        for rank, r in pipes.items():
            if r.poll(max(0.0, deadline - time.monotonic())):
                try:
                    out["workers"][rank] = r.recv()
                except EOFError:        # the process died without reporting (a victim)
                    out["workers"][rank] = None
            else:
                out["workers"][rank] = "MISSING (hung past the episode limit)"
        for rank, p in procs.items():
            out["exitcodes"][rank] = _exitcode(p, max(0.1, min(10.0, deadline - time.monotonic())))
        for i, p in enumerate(agg_procs):
            out["exitcodes"][f"agg{i}"] = _exitcode(p, 0)
        out["seconds"] = EPISODE_LIMIT - (deadline - time.monotonic())
        out["addresses"] = {}
        first = dist.PrefixStore("1", dist.PrefixStore("c1/", store))  # the first communicator's keys
        for rank in range(world):
            key = f"aggregator/{rank}"
            if first.check([key]):
                out["addresses"][rank] = first.get(key).decode()
        return out
    finally:
        for p in list(procs.values()) + agg_procs:
            if _exitcode(p, 0) is None:
                p.kill()
            _exitcode(p, 10)
        del store


def names_peer(msg: str, peers: list[str]) -> bool:
    return any(p in msg for p in peers)


def check_survivors(point: str, spec: dict, out: dict) -> list[str]:
    """Every survivor raised a documented error in time (naming the peer), then stayed poisoned,
    and close() returned; the victim really died at its kill point."""
    problems = []
    world = spec.get("world", 2)
    victims = spec.get("victims", ())
    died = [v for v in victims if out["exitcodes"].get(v) == -signal.SIGKILL]
    # Of two victims, the second may hear of the first's death before it reaches its own kill point
    # (a loaded machine: once in a suite run): it is then a survivor, and judged as one.
    outlived = [v for v in victims if v not in died] if died and len(victims) > 1 else []
    for v in victims:
        if v not in died and v not in outlived:
            problems.append(f"victim rank {v} exit code {out['exitcodes'].get(v)}: kill point "
                            f"not reached; its report: {out['workers'].get(v)}")
    if spec.get("aggregator_victim") is not None:
        code = out["exitcodes"].get(f"agg{spec['aggregator_victim']}")
        if code != -signal.SIGKILL:
            problems.append(f"aggregator exit code {code}: kill point not reached")
    peers = []
    for v in died or victims:
        peers += [f"rank {v}", f"aggregator {v}", f"aggregator/{v}"]
        if v in out.get("addresses", {}):
            peers.append(out["addresses"][v])
    if spec.get("aggregator_victim") is not None:
        a = spec["aggregator_victim"]
        peers += [f"aggregator {a}", out["aggs"][a]]
    for rank in range(world):
        if rank in victims and rank not in outlived:
            continue
        res = out["workers"].get(rank)
        if not isinstance(res, dict):
            problems.append(f"survivor rank {rank}: {res}")
            continue
        where = f"survivor rank {rank}"
        if res["error"] not in SURVIVOR_ERRORS:
            problems.append(f"{where} raised {res['error']}: {res['msg']}")
            continue
        if res["error_s"] > TIMEOUT + SLACK:
            problems.append(f"{where}: {res['error']} after {res['error_s']:.1f} s > deadline")
        # In a cascade another survivor may give up first and leave; then this one may be told
        # "rank S left the job" (its aggregator) or "rank S closed its connection" (the ring's
        # check round) before it hears of the dead peer (see docs/reliability.md).
        cascade = [text.format(s) for s in range(world) if s not in victims and s != rank
                   for text in ("rank {} left the job", "rank {} closed its connection")]
        if res["error"] != "CollectiveTimeout" and not names_peer(res["msg"], peers + cascade):
            problems.append(f"{where}: {res['error']} does not name the peer {peers}: {res['msg']}")
        if re.search(r"(rank \d+: )\1", res["msg"]):
            problems.append(f"{where}: a rank is named twice in a row: {res['msg']}")
        if not res["exact"]:
            problems.append(f"{where}: a collective that completed was not exact")
        if res["then"] is not None and (res["then"] != "PoisonedError" or res["then_s"] > AT_ONCE):
            problems.append(f"{where}: the next call gave {res['then']} after {res['then_s']:.2f} s")
        if res["close_s"] is not None and res["close_s"] > CLOSE_LIMIT:
            problems.append(f"{where}: close() took {res['close_s']:.1f} s")
        for name, seconds in res.get("async_errors", []):
            if name not in SURVIVOR_ERRORS or seconds > TIMEOUT + SLACK:
                problems.append(f"{where}: async work raised {name} after {seconds:.1f} s")
    return problems


# ---- kill points ---------------------------------------------------------------------------------
def _w(kill, victims=(1,), **extra):
    return dict(kill=kill, victims=victims, **extra)


COLOCATED = {
    # init (a shorter deadline: these survivors may have to wait it out)
    "worker-before-init": _w(("now", 0), options=dict(timeout=3.0)),
    "rank0-before-init-no-job-key": _w(("now", 0), victims=(0,), options=dict(timeout=3.0)),
    "worker-at-first-connect": _w(("connect", 1), options=dict(timeout=3.0)),
    "worker-mid-handshake": _w(("proof", 1), options=dict(timeout=3.0)),
    "worker-right-after-init": _w(("after-init", 0)),
    # first collective
    "worker-during-scan": _w(("scan", 1)),
    "worker-first-contribution": _w(("send", 1)),
    "worker-mid-collective-1": _w(("send", 25)),
    "worker-half-written-header": _w(("partial-header", 5)),
    "worker-half-written-payload": _w(("partial-payload", 7)),
    "agg-first-peer-contribution": _w(("agg-contribute", 1)),
    "agg-third-result": _w(("agg-broadcast", 3)),
    "worker-first-remote-result": _w(("recv-result", 1)),
    # later collectives
    "worker-mid-collective-3": _w(("send", 150)),
    "agg-peer-contribution-100": _w(("agg-contribute", 100)),
    "agg-result-120": _w(("agg-broadcast", 120)),
    "worker-remote-result-100": _w(("recv-result", 100)),
    "worker-scan-of-collective-3": _w(("scan", 3)),
    "between-collectives-2-3": _w(("between", 2)),
    "test-kills-worker-between-collectives": _w(("none", 0), parent_kill=(1, 2), pause_before=(2,)),
    "timer-150ms": _w(("timer", 0.15), collectives=150),
    "timer-500ms": _w(("timer", 0.5), collectives=150),
    "worker-during-close": _w(("close", 1), victim_collectives=2, collectives=4),
    "async-ops-queued": _w(("between", 3), **{"async": 3}, collectives=9),
    "3-ranks-rank2-mid-collective": _w(("send", 20), victims=(2,), world=3),
    "3-ranks-rank0-mid-collective": _w(("send", 40), victims=(0,), world=3),
    "3-streams-1-credit": _w(("send", 30), options=dict(streams=3, credits=1)),
    "two-victims-of-4": _w(("send", 15), victims=(1, 3), world=4, collectives=3),
}

_RING = dict(env={"SPARCOLL_ALGORITHM": "ring"})    # every collective on gloo's ring, with its check
RING = {
    "ring-first-data": _w(("ring-data", 1), **_RING),
    "ring-data-of-collective-4": _w(("ring-data", 4), **_RING),
    "ring-first-check": _w(("ring-check", 1), **_RING),
    "ring-check-of-collective-3": _w(("ring-check", 3), **_RING),
    "ring-between-collectives-2-3": _w(("between", 2), **_RING),
    "ring-timer-150ms": _w(("timer", 0.15), collectives=150, **_RING),
    "ring-3-ranks-rank0-data": _w(("ring-data", 3), victims=(0,), world=3, **_RING),
    "ring-3-ranks-rank2-check": _w(("ring-check", 2), victims=(2,), world=3, **_RING),
}

SECRET = b"test-fault-secret"
_DED = dict(env={"SPARCOLL_SECRET": SECRET.decode()})


def _a(kill=None, **extra):
    return dict(aggregators=[dict(secret=SECRET, kill=kill)], aggregator_victim=0, **_DED, **extra)


DEDICATED = {
    "aggregator-dead-before-init": _a(kill_aggregator_first=True, options=dict(timeout=3.0)),
    "aggregator-second-handshake": _a(("accept", 2), options=dict(timeout=3.0)),
    "aggregator-first-contribution": _a(("agg-contribute", 1)),
    "aggregator-mid-collective-1": _a(("agg-contribute", 40)),
    "aggregator-mid-collective-2": _a(("agg-contribute", 300)),
    "aggregator-fifth-result": _a(("agg-broadcast", 5)),
    "test-kills-aggregator-between-collectives": _a(parent_kill=("aggregator", 2),
                                                    pause_before=(2,)),
    "one-of-two-aggregators": dict(aggregators=[dict(secret=SECRET),
                                                dict(secret=SECRET, kill=("agg-contribute", 30))],
                                   aggregator_victim=1, **_DED),
    "worker-on-dedicated-mid-collective": dict(aggregators=[dict(secret=SECRET)],
                                               **_w(("send", 30)), **_DED),
    "worker-on-dedicated-at-init": dict(aggregators=[dict(secret=SECRET)],
                                        **_w(("after-init", 0)), **_DED),
}


def _run_all(table: dict) -> dict:
    with ThreadPoolExecutor(PARALLEL) as pool:
        futures = {name: pool.submit(run_episode, spec) for name, spec in table.items()}
        out = {}
        for name, future in futures.items():
            try:
                out[name] = future.result(timeout=EPISODE_LIMIT * len(table))
            except BaseException:
                out[name] = {"harness": traceback.format_exc()}
        return out


@pytest.fixture(scope="module")
def colocated_outcomes():
    return _run_all(COLOCATED)


@pytest.fixture(scope="module")
def dedicated_outcomes():
    return _run_all(DEDICATED)


@pytest.fixture(scope="module")
def ring_outcomes():
    return _run_all(RING)


def _assert_survivors_report(point: str, episodes: dict, outcomes: dict) -> None:
    out = outcomes[point]
    assert "harness" not in out, out.get("harness")
    problems = check_survivors(point, episodes[point], out)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("point", list(COLOCATED))
def test_worker_killed_colocated(point, colocated_outcomes):
    _assert_survivors_report(point, COLOCATED, colocated_outcomes)


@pytest.mark.parametrize("point", list(DEDICATED))
def test_killed_with_dedicated_aggregator(point, dedicated_outcomes):
    _assert_survivors_report(point, DEDICATED, dedicated_outcomes)


@pytest.mark.parametrize("point", list(RING))
def test_worker_killed_on_glooss_ring(point, ring_outcomes):
    _assert_survivors_report(point, RING, ring_outcomes)


def test_dedicated_aggregator_keeps_serving_other_jobs():
    """Job A loses a worker mid-collective while job B runs on the same aggregator: B is exact and
    complete, A's survivor gets a PeerError; then a new job C on that aggregator is exact too."""
    ctx = fork_context()
    r, w = ctx.Pipe(duplex=False)
    agg = fork_process(_aggregator_child, w, dict(secret=SECRET))
    _start(agg)
    w.close()
    try:
        assert r.poll(30)
        address = r.recv()
        shared = dict(options=dict(aggregators=[address]), **_DED)
        job_a = dict(shared, **_w(("send", 60)), collectives=8)
        job_b = dict(shared, collectives=8)
        with ThreadPoolExecutor(2) as pool:
            fa, fb = pool.submit(run_episode, job_a), pool.submit(run_episode, job_b)
            out_a, out_b = fa.result(timeout=2 * EPISODE_LIMIT), fb.result(timeout=2 * EPISODE_LIMIT)
        problems = check_survivors("job A", job_a, out_a)
        assert not problems, "\n".join(problems)
        for rank, res in out_b["workers"].items():
            assert isinstance(res, dict) and res["error"] is None, (rank, res)
            assert res["completed"] == 8 and res["exact"], (rank, res)
        out_c = run_episode(dict(shared, collectives=2, world=3))
        for rank, res in out_c["workers"].items():
            assert isinstance(res, dict) and res["error"] is None, (rank, res)
            assert res["completed"] == 2 and res["exact"], (rank, res)
        assert _exitcode(agg, 0) is None
    finally:
        agg.kill()
        _exitcode(agg, 10)


# ---- in-process: mismatches, poisoning, timeouts -------------------------------------------------
def in_threads(world: int, target, join_timeout: float = 30.0, **options) -> list:
    """Run target(comm, rank) on `world` in-process Communicators sharing a HashStore."""
    store = dist.HashStore()
    results: list = [None] * world
    close_seconds: list = [None] * world

    def run(rank):
        comm = None
        try:
            comm = Communicator(dist.PrefixStore("m/", store), rank, world,
                                **dict(dict(timeout=5.0), **options))
            results[rank] = target(comm, rank)
        except BaseException as exc:
            results[rank] = exc
        finally:
            if comm is not None:
                t = time.monotonic()
                comm.close()
                close_seconds[rank] = time.monotonic() - t   # checked below, in the test's thread
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    join_all(threads, join_timeout)
    assert all(s < CLOSE_LIMIT for s in close_seconds if s is not None), close_seconds
    return results


@pytest.mark.parametrize("mode", ["colocated", "dedicated"])
def test_calls_in_different_order_raise_on_every_rank_then_poison(mode, request):
    """Rank 0 reduces A (1000 elements) then B (5000); rank 1 B then A: the first collective is a
    mismatch on both ranks, and every later call raises PoisonedError at once."""
    options = {}
    if mode == "dedicated":
        options["aggregators"] = request.getfixturevalue("dedicated_in_process")

    def target(comm, rank):
        sizes = [1000, 5000] if rank == 0 else [5000, 1000]
        first = outcome_of(lambda: comm.allreduce(torch.ones(sizes[0])))
        second = outcome_of(lambda: comm.allreduce(torch.ones(sizes[1])))
        third = outcome_of(lambda: comm.allreduce(torch.ones(10), async_op=True).wait(10))
        return first, second, third

    for rank, (first, second, third) in enumerate(in_threads(2, target, **options)):
        assert first[0] == "MismatchError" and "numel" in first[1], (rank, first)
        assert first[2] < TIMEOUT, (rank, first)
        for later in (second, third):
            assert later[0] == "PoisonedError" and later[2] < AT_ONCE, (rank, later)


def test_async_calls_in_different_order_raise_on_every_rank():
    def target(comm, rank):
        sizes = [1000, 3000] if rank == 0 else [3000, 1000]
        first = comm.allreduce(torch.ones(sizes[0]), async_op=True)
        # Where the first has failed by then (this thread descheduled between the calls), the
        # second call is refused at once; else its Work raises. PoisonedError either way.
        second = outcome_of(lambda: comm.allreduce(torch.ones(sizes[1]), async_op=True).wait(10))
        return outcome_of(lambda: first.wait(10)), second

    for rank, (first, second) in enumerate(in_threads(2, target)):
        assert first[0] == "MismatchError", (rank, first)
        assert second[0] == "PoisonedError", (rank, second)


@pytest.mark.parametrize("path,numel", [("sparse", 5000), ("dedicated", 5000), ("ring", 300_000),
                                        ("ring", 500)])
def test_same_size_tensors_swapped_are_told_apart_by_their_tags(path, numel, request):
    """Two tensors of one size, A (tag 1, ones) and B (tag 2, twos), reduced in turn for 3 rounds;
    then rank 1 reduces B where rank 0 reduces A (a skipped branch). Untagged, that sum is 3 on
    both ranks, with no error; tagged, both ranks raise MismatchError naming both tags, and nothing
    is summed. Every path: the aggregators' check (sparse path, colocated or dedicated), and the
    ring's check round, with a larger call's data beside it on rank 0 (300K: each rank expects A,
    which came after B last time) and after it on rank 1, or a tiny call's in it (500)."""
    options = dict(algorithm="sparse" if path != "ring" else "ring")
    if path == "dedicated":
        options["aggregators"] = request.getfixturevalue("dedicated_in_process")

    def target(comm, rank):
        sums = []
        for _ in range(3):
            for tag, value in ((1, 1.0), (2, 2.0)):
                x = torch.full((numel,), value)
                comm.allreduce(x, tag=tag)
                sums.append(bool((x == 2 * value).all()))
        swapped = torch.full((numel,), 2.0 if rank else 1.0)
        before = swapped.clone()
        return sums, outcome_of(lambda: comm.allreduce(swapped, tag=2 if rank else 1)), \
            bool(torch.equal(swapped, before))

    for rank, (sums, outcome, untouched) in enumerate(in_threads(2, target, **options)):
        assert all(sums), (rank, sums)
        assert outcome[0] == "MismatchError" and "tag 1" in outcome[1] and "tag 2" in outcome[1], \
            (rank, outcome)
        assert outcome[2] < TIMEOUT, (rank, outcome)
        assert untouched, rank


def test_a_tag_a_header_cannot_hold_is_refused_as_such():
    def target(comm, rank):
        return [outcome_of(lambda t=t: comm.allreduce(torch.ones(8), tag=t), (ValueError,))
                for t in (-1, wire.MAX_TAG + 1, 1.5, True)]

    for rank, outcomes in enumerate(in_threads(2, target)):
        for outcome in outcomes:
            assert outcome[0] == "ValueError" and "tag must be" in outcome[1], (rank, outcome)


def test_a_rank_whose_message_was_malformed_hears_why_its_aggregator_closed(dedicated_in_process):
    """A rank's connection carries a malformed message (here a RESULT, which only aggregators
    send): the aggregator closes it and its peers' collectives fail with the reason. The rank
    itself hears it too, in an ERROR for the connection sent before the close; on the code before
    it saw only "aggregator 0 ... closed the connection"."""
    ready = threading.Barrier(2, timeout=TIMEOUT)

    def target(comm, rank):
        x = torch.ones(4096)
        comm.allreduce(x)
        exact = bool((x == 2).all())
        ready.wait()
        if rank == 1:
            garbage = wire.data_header(wire.Kind.RESULT, stream=0, job=comm.job, collective=99, seq=0,
                                       count=0, progress=0, descriptor=(4096, 256, 0, 0, 0))
            comm._worker.connections[0].send([garbage])
        return exact, outcome_of(lambda: comm.allreduce(torch.ones(4096)))

    for rank, (exact, outcome) in enumerate(in_threads(2, target, aggregators=dedicated_in_process)):
        assert exact, rank
        assert outcome[0] in ("PeerError", "PoisonedError"), (rank, outcome)
        assert "rank 1 sent a malformed message (unexpected RESULT message)" in outcome[1], (rank, outcome)
        assert outcome[2] < TIMEOUT, (rank, outcome)


@pytest.mark.parametrize("what", ["op", "dtype", "block_size", "numel_same_blocks"])
def test_mismatched_descriptor_raises_on_every_rank(what):
    def target(comm, rank):
        x = torch.ones(4096, dtype=torch.float64 if (what == "dtype" and rank) else torch.float32)
        if what == "numel_same_blocks":   # 4000 and 4096 elements: both 16 blocks of 256
            x = torch.ones(4000 if rank else 4096)
        op = "avg" if (what == "op" and rank) else "sum"
        return outcome_of(lambda: comm.allreduce(x, op=op))

    if what == "block_size":
        store = dist.HashStore()
        results = [None, None]

        def run(rank):      # refused at init since a review (test_ranks_whose_block_sizes_differ_fail_init_at_once)
            results[rank] = outcome_of(lambda: Communicator(dist.PrefixStore("b/", store), rank, 2, timeout=5.0,
                                                            block_size=256 if rank == 0 else 128).close())
        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    else:
        results = in_threads(2, target)
    for rank, outcome in enumerate(results):
        assert outcome[0] == "MismatchError", (what, rank, outcome)
        assert outcome[2] < TIMEOUT, (what, rank, outcome)


def test_a_mismatch_reaches_the_peer_as_one_when_the_rank_that_saw_it_leaves_first(monkeypatch):
    """Aggregator 0 finds the ranks' calls differ and tells both; its word to rank 1 is slow, and
    so is rank 1's own part to aggregator 1 (a loaded machine; here delays). Rank 0 raises and
    leaves, and its BYE reaches aggregator 1 before rank 1's part, so aggregator 1 never sees the
    mismatch: the BYE says why rank 0 left, and rank 1 still raises the MismatchError (a CI run had
    seen PeerError "rank 0 left the job", the BYE saying nothing)."""
    send_error = server_module._RemoteWorker.send_error
    contribute = aggregator_module.AggregatorJob.contribute
    released, held = threading.Event(), []

    def held_to_rank_1(self, *args):      # until both ranks raised: only the BYE can tell rank 1
        released.wait(30)
        send_error(self, *args)

    def slow_to_rank_1(self, *args):
        if self.conn.peer.startswith("rank 1 "):
            held.append(threading.Thread(target=held_to_rank_1, args=(self, *args), daemon=True))
            held[-1].start()
        else:
            send_error(self, *args)

    def slow_from_rank_1_to_its_own(self, rank, *args, **kwargs):
        if rank == 1 and self.agg_index == 1:
            time.sleep(0.3)
        return contribute(self, rank, *args, **kwargs)
    monkeypatch.setattr(server_module._RemoteWorker, "send_error", slow_to_rank_1)
    monkeypatch.setattr(aggregator_module.AggregatorJob, "contribute", slow_from_rank_1_to_its_own)

    def target(comm, rank):
        return outcome_of(lambda: comm.allreduce(torch.ones(4000 if rank else 4096)))
    try:
        outcomes = in_threads(2, target)
    finally:
        released.set()
        for thread in held:
            thread.join(5.0)
    for rank, outcome in enumerate(outcomes):
        assert outcome[0] == "MismatchError", (rank, outcome)
        assert outcome[2] < TIMEOUT, (rank, outcome)


def test_mismatched_init_options_refused_on_every_rank(store):
    """Ranks that disagree on the job's configuration (here message_blocks) fail at init."""
    results = [None, None]

    def run(rank):
        results[rank] = outcome_of(lambda: Communicator(
            dist.PrefixStore("o/", store), rank, 2, timeout=5.0,
            message_blocks=64 if rank == 0 else 128).close())
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for rank, outcome in enumerate(results):
        assert outcome[0] == "MismatchError" and "message_blocks" in outcome[1], outcome
        assert outcome[2] < TIMEOUT


def test_a_rank_whose_options_are_refused_tells_its_peers_at_once(store):
    """Rank 1 gives block_size=0: it raised at once, and rank 0 waited for its aggregator until the
    timeout (the backend's group's is 30 minutes), then could not say which rank or why."""
    store = dist.PrefixStore("refused/", store)
    results = {}

    def run(rank):
        results[rank] = outcome_of(lambda: Communicator(store, rank, 2, timeout=20.0,
                                                        **({"block_size": 0} if rank else {})).close(),
                                   expected=(sparcoll.SparcollError, ValueError))
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results[1][0] == "ValueError" and "block_size=0" in results[1][1], results
    assert results[0][0] == "PeerError" and "rank 1 gave up init" in results[0][1] \
        and "block_size=0" in results[0][1], results
    assert results[0][2] < 5.0, results


def test_peer_that_gave_up_init_is_named_with_its_reason(store):
    """A rank that fails init closes its aggregator; a peer that finds it gone reports that rank's
    reason (announced in the Store) at once, not a refused connection after the whole timeout."""
    store = dist.PrefixStore("g/", store)
    with socket.socket() as probe:          # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{probe.getsockname()[1]}"
    store.set("1/aggregator/1", gone)        # keys of the first communicator on this prefix
    store.set("1/init-failed/1", "MismatchError\nhandshake refused: message_blocks differ")
    outcome = outcome_of(lambda: Communicator(store, 0, 2, timeout=20.0).close())
    assert outcome[0] == "MismatchError", outcome
    assert "rank 1 gave up init" in outcome[1] and "message_blocks" in outcome[1], outcome
    assert outcome[2] < 5.0, outcome


def test_a_peer_that_gives_up_while_the_ring_is_set_up_is_named_at_once(monkeypatch):
    """The ring's star is set up after the aggregators' connections: rank 0 waits there for every
    rank to connect. Rank 1 gives up at that point (here its star connection fails): rank 0 used to
    wait the rest of init's timeout (20 s here) and report ranks that never connected; it now
    raises rank 1's own reason, as the other waits of init do."""
    from sparcoll import star as star_module
    original = star_module.Star.connect.__func__

    def failing_for_rank_1(cls, store, rank, *args, **kwargs):
        if rank == 1:
            raise sparcoll.errors.PeerError("injected: rank 0's star is out of reach")
        return original(cls, store, rank, *args, **kwargs)
    monkeypatch.setattr(star_module.Star, "connect", classmethod(failing_for_rank_1))
    store = dist.HashStore()
    outcomes = [None, None]

    def rank(r):
        outcomes[r] = outcome_of(lambda: Communicator(dist.PrefixStore("s/", store), r, 2, timeout=20.0,
                                                      algorithm="auto").close())
    on_threads(rank, 2, timeout=60)
    assert outcomes[1][0] == "PeerError", outcomes
    kind, text, seconds = outcomes[0]
    assert kind == "PeerError" and "rank 1 gave up init" in text and "star is out of reach" in text, outcomes
    assert seconds < 5.0, outcomes


def init_and_close(rank: int, world: int) -> dict:
    """sparcoll.init, rank 1 a second late in making its ring's gloo group, then close at once.
    Returns when (time.monotonic: one clock for every process of the machine) its gloo group was up
    and its init returned."""
    from sparcoll import ring as ring_module
    original = ring_module.Ring._group
    times = {}

    def late_on_rank_1(self, store, timeout, host):
        group = original(self, store, timeout, host)
        if self.rank == 1:
            time.sleep(1.0)
        times["group up"] = time.monotonic()
        return group
    ring_module.Ring._group = late_on_rank_1
    comm = sparcoll.init(timeout=20, algorithm="ring")
    times["init returned"] = time.monotonic()
    comm.close()
    return times


def test_no_rank_returns_from_init_before_every_ranks_gloo_group_is_up():
    """gloo's group of the ring is up on one rank as soon as its connection to the peer is, while the
    peer may still be reading it: rank 0 returned from init then, and if it closed at once, rank 1's
    init failed with gloo's "Connection closed by peer" (seen in test_ipv6.py on a loaded machine).
    Whether it fails depends on that race, so the test looks at the order, with rank 1 a second late:
    init now returns on no rank before the ring is up on every rank."""
    times = run_ranks(init_and_close, 2, timeout=60)
    assert times[0]["init returned"] >= times[1]["group up"], times


def test_ranks_that_disagree_on_their_aggregators_fail_init_at_once(store):
    """One rank with dedicated aggregators, its peer colocated (an environment variable set on one
    host only): MismatchError on the first, its reason at once on the other, not both waiting out
    init's timeout for keys that never come."""
    server = server_module.AggregatorServer("127.0.0.1", 0, b"")
    results = [None, None]

    def run(rank):
        options = dict(aggregators=[server.address]) if rank == 1 else {}
        results[rank] = outcome_of(lambda: Communicator(dist.PrefixStore("layout/", store), rank, 2,
                                                        timeout=20.0, **options).close())
    try:
        on_threads(run, 2, timeout=40)
    finally:
        server.close()
    assert results[1][0] == "MismatchError" and "1 dedicated, rank 0's are colocated" in results[1][1], results
    assert "rank 1 gave up init" in results[0][1] and "colocated" in results[0][1], results
    assert max(r[2] for r in results) < 5.0, results


def test_ranks_whose_block_sizes_differ_fail_init_at_once(store):
    """A host with another $SPARCOLL_BLOCK_SIZE: small tensors (the ring's, gathered) summed alike, and
    the first MismatchError came at the first large sparse collective (a review). Now init refuses it
    on that rank, and its peer hears the reason at once."""
    results = [None, None]

    def run(rank):
        results[rank] = outcome_of(lambda: Communicator(dist.PrefixStore("block-size/", store), rank, 2,
                                                        timeout=20.0, block_size=128 if rank == 1 else 256).close())
    on_threads(run, 2, timeout=40)
    assert results[1][0] == "MismatchError" and "its block size is 128, rank 0's 256" in results[1][1], results
    assert "rank 1 gave up init" in results[0][1] and "block size" in results[0][1], results
    assert max(r[2] for r in results) < 5.0, results


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_dedicated_aggregator_stopped_by_a_signal_tells_every_worker_why(sig):
    """Its workers' communicators fail with the reason, not "closed the connection" (before; and
    SIGHUP killed it without a word), and it exits cleanly."""
    proc, address = start_aggregator()
    try:
        first_done, stopped = threading.Barrier(2, timeout=30), threading.Event()

        def target(comm, rank):
            tensor = torch.ones(1000)
            comm.allreduce(tensor)
            assert torch.equal(tensor, torch.full((1000,), 2.0))
            if first_done.wait() == 0:
                proc.send_signal(sig)
                proc.wait(timeout=20)
                stopped.set()
            assert stopped.wait(30)
            return outcome_of(lambda: comm.allreduce(torch.ones(1000)))

        results = in_threads(2, target, aggregators=[address])
    finally:
        stop(proc)
    assert proc.returncode == 0, proc.returncode
    for outcome in results:
        assert outcome[0] in ("PeerError", "PoisonedError"), outcome
        assert f"the aggregator at {address} was stopped ({sig.name})" in outcome[1], outcome


def test_an_aggregator_stopped_while_a_rank_waits_in_init_fails_that_init_and_tells_the_peers():
    """Rank 0 is connected and waits in init for rank 1 when its dedicated aggregator is stopped:
    its init fails at once with the reason, and rank 1, coming later, hears it at once. Before,
    rank 0 waited out init's timeout, then blamed rank 1 for not coming that far (a review)."""
    proc, address = start_aggregator()
    store = dist.PrefixStore("m/", dist.HashStore())
    outcomes: dict[int, tuple] = {}

    def init(rank):
        start = time.monotonic()
        outcomes[rank] = (*outcome_of(lambda: Communicator(store, rank, 2, aggregators=[address],
                                                           timeout=30.0).close()), start)
    try:
        first = threading.Thread(target=init, args=(0,), daemon=True)
        first.start()
        assert wait_for(lambda: store.check(["1/ready/connected/0"]), 30), "rank 0 never connected"
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        first.join(30)
        init(1)
    finally:
        stop(proc)
    (kind, text, _, _), (late_kind, late_text, late_s, _) = outcomes[0], outcomes[1]
    assert kind == "PeerError" and f"the aggregator at {address} was stopped (SIGTERM)" in text, outcomes
    assert outcomes[0][3] + outcomes[0][2] - stopped < 10, outcomes     # not init's 30 s
    assert late_kind == "PeerError" and "rank 0 gave up init" in late_text and "was stopped" in late_text, outcomes
    assert late_s < 10, outcomes


@pytest.mark.parametrize("mode", ["colocated", "dedicated"])
def test_a_rank_late_for_a_small_call_is_named_by_every_rank(mode, request):
    """A small tensor's single round goes through rank 0, which waits for every rank's row: rank 0
    named the late rank 3, the others blamed rank 0 ("rank 1: rank 0 did not take part in the
    ring's check"; a review, at 32 ranks). Now they wait a moment past their deadline for rank
    0's report."""
    options = {"aggregators": request.getfixturevalue("dedicated_in_process")} if mode == "dedicated" else {}
    done = threading.Semaphore(0)

    def target(comm, rank):
        if rank == 3:
            for _ in range(3):
                done.acquire(timeout=20)
            return None
        try:
            return outcome_of(lambda: comm.allreduce(torch.ones(8)))
        finally:
            done.release()

    outcomes = in_threads(4, target, timeout=1.5, algorithm="auto", **options)[:3]
    for rank, (kind, text, _) in enumerate(outcomes):     # its own timeout, or rank 0's report of it (a timeout
        assert kind == "CollectiveTimeout" and "rank 3 did not take part" in text, (rank, outcomes)     # too)


def test_a_job_of_more_ranks_than_the_aggregators_handshake_limit_starts(monkeypatch):
    """Its ranks connect at once, and connections over the limit are closed unanswered: they are
    tried again after a pause with jitter. Before, those ranks' init failed ("Connection reset by
    peer") and so did the job's: any job of more ranks than the limit (256 by default) connecting
    at the same moment, to a dedicated aggregator or to colocated ones."""
    from sparcoll.server import AggregatorServer
    server = AggregatorServer("127.0.0.1", 0, b"", max_handshakes=1)
    try:
        def exact(comm, rank):
            x = make_input(0, rank, 5000)
            comm.allreduce(x)
            return torch.equal(x, expected(0, 8, 5000))
        assert in_threads(8, exact, aggregators=[server.address], timeout=30.0) == [True] * 8
        assert server.over_cap.count > 0       # (else the limit was never met, and nothing was shown)
    finally:
        server.close()


def test_a_rank_that_gave_up_init_for_a_peers_reason_passes_the_reason_on_as_it_is():
    """Ranks that give up because a peer did announce that peer's reason, not their own wrapping
    of it: "rank 2 gave up init: rank 3 gave up init: rank 4 gave up init: handshake ... failed"."""
    from sparcoll.bootstrap import Rendezvous
    store = dist.HashStore()
    rendezvous = Rendezvous(store, 0, 4, 5.0)
    rendezvous.store.set("init-failed/2", "PeerError\nrank 4 gave up init: handshake failed")
    rendezvous.store.set("init-failed/3", "ValueError\nblock_size=0")
    assert str(rendezvous._failure_of(2)) == "rank 4 gave up init: handshake failed"
    assert str(rendezvous._failure_of(3)) == "rank 3 gave up init: block_size=0"


@pytest.mark.parametrize("host", ["127.0.0.1", "192.0.2.1"])       # loopback; not this host's (TEST-NET-1)
def test_a_peers_aggregator_at_a_loopback_address_it_cannot_reach_is_named_with_what_to_do(host):
    """A rank of another host whose aggregator listens on loopback (its hostname resolved there, say)
    cost init's timeout with "could not connect to aggregator 127.0.0.2:42621 ... Connection
    refused": neither the rank nor what was wrong (a review of docs/cluster.md)."""
    import os
    from sparcoll.bootstrap import Rendezvous
    hello = wire.Hello(1, 0, 1, wire.JobConfig(2, 2, 1, 1, 1), os.urandom(wire.NONCE_BYTES))
    hint = "that is a loopback address: if rank 1 runs on another host, it listens where only its own host reaches"
    for own in ("192.0.2.2:7000", "127.0.0.1:7000"):    # where this rank's own aggregator listens
        rendezvous = Rendezvous(dist.HashStore(), 0, 2, 0.5)
        rendezvous.own_address = own
        with socket.socket() as bound:      # bound, never listening: refused
            bound.bind(("127.0.0.1", 0))
            address = f"{host}:{bound.getsockname()[1]}"
            kind, text, _ = outcome_of(lambda: rendezvous.connect(1, address, hello, b"s" * 32,
                                                                  bytes(wire.MAC_BYTES), colocated=True))
        assert kind == "CollectiveTimeout" and f"could not connect to rank 1's aggregator {address}" in text, text
        # (a job on loopback alone is on one host: no hint there)
        assert (hint in text) == (host == "127.0.0.1" and own.startswith("192.")), (own, text)


def test_a_rank_retrying_a_refused_dedicated_aggregator_asks_the_store_a_few_times_a_second(monkeypatch):
    """It looks whether a peer gave up init between retries, at most every FAILURE_POLL (0.25 s): at
    every 50 ms retry, a thousand ranks waiting for a late aggregator would ask rank 0's Store
    20,000 times a second (a review)."""
    from sparcoll import bootstrap
    looks = []
    original = bootstrap.Rendezvous._first_failure
    monkeypatch.setattr(bootstrap.Rendezvous, "_first_failure", lambda self: looks.append(1) or original(self))
    with socket.socket() as bound:      # bound, never listening: refused
        bound.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{bound.getsockname()[1]}"
        kind, text, seconds = outcome_of(lambda: Communicator(dist.PrefixStore("r/", dist.HashStore()), 0, 1,
                                                              aggregators=[address], timeout=2.0))
    assert kind == "CollectiveTimeout" and address in text, (kind, text)
    assert 2 <= len(looks) <= seconds / bootstrap.FAILURE_POLL + 3, (len(looks), seconds)


@pytest.mark.parametrize("numel", [1000, 256 * 1024])
def test_missing_call_times_out_naming_the_peer_then_poisons(numel):
    """Rank 2 never makes the call: the others' timeouts name it (their own aggregators have
    nothing of it from rank 2), on the single round of a small tensor and the sparse path alike."""
    done = threading.Semaphore(0)

    def target(comm, rank):
        if rank == 2:                       # rank 2 stays in the job until both others are done,
            for _ in range(2):              # but never calls the collective
                done.acquire(timeout=20)
            return None
        try:
            first = outcome_of(lambda: comm.allreduce(torch.ones(numel)))
            second = outcome_of(lambda: comm.allreduce(torch.ones(numel)))
        finally:
            done.release()
        return first, second

    deadline = 1.5
    (first, second), (other, _), _ = in_threads(3, target, timeout=deadline, algorithm="sparse")
    # The first to time out leaves the job, and the other may learn of that first: it then reports
    # the first one's error.
    assert "CollectiveTimeout" in (first[0], other[0]), (first, other)
    for outcome in (first, other):
        assert outcome[0] in ("CollectiveTimeout", "PeerError") and "aggregator 2" in outcome[1], outcome
        assert "rank 2 has sent nothing of it to this rank's aggregator" in outcome[1], outcome
    # Not before the deadline (it starts after `first` began timing; 0.05 s for clock rounding),
    # and not at some much later time; the upper bound is loose so that a loaded machine cannot
    # fail it.
    timed_out = first if first[0] == "CollectiveTimeout" else other
    assert deadline - 0.05 <= timed_out[2] < 10 * deadline, timed_out
    assert second[0] == "PoisonedError" and second[2] < 1.0, second


@pytest.mark.parametrize("mode", ["colocated", "dedicated"])
def test_a_rank_that_gave_up_a_collective_owns_its_tensor_again(mode, request):
    """Rank 0 times out waiting for rank 1, writes its tensor, and only then rank 1 calls. Nothing
    of the collective rank 0 gave up writes or reads rank 0's tensor after the error: its own
    aggregator, which sums peers' contributions in place into the memory rank 0 lent it, works on a
    copy. Before, rank 0's tensor became its new values plus rank 1's, and rank 1 got that as part
    of its sum, silently (colocated; with dedicated aggregators rank 0 lends them nothing, and the
    same held before)."""
    options = {"aggregators": request.getfixturevalue("dedicated_in_process")} \
        if mode == "dedicated" else {}
    numel = 64 * 1024
    gave_up, done = threading.Event(), threading.Event()

    def target(comm, rank):
        tensor = torch.full((numel,), float(rank + 1))
        if rank == 1:
            try:
                assert gave_up.wait(20)
                return outcome_of(lambda: comm.allreduce(tensor)), tensor
            finally:
                done.set()
        try:
            outcome = outcome_of(lambda: comm.allreduce(tensor))
            tensor.fill_(5)
        finally:
            gave_up.set()
        assert done.wait(20)            # rank 0 stays in the job until rank 1's call ended
        return outcome, tensor

    (first, mine), (late, theirs) = in_threads(2, target, timeout=1.5, algorithm="sparse", **options)
    assert first[0] == "CollectiveTimeout", first
    assert torch.equal(mine, torch.full((numel,), 5.0))
    assert late[0] == "NO ERROR", late      # the others may still complete it, with rank 0's data
    assert torch.equal(theirs, torch.full((numel,), 3.0))


def test_a_collective_that_fails_while_a_result_is_being_placed_raises_after_it(monkeypatch):
    """A receiver thread is placing a result in rank 0's tensor (held there 0.5 s) when rank 0's
    collective fails (close() fails it): rank 0's Work fails only once that placement ended, so
    nothing writes the tensor after the caller has the error. Before, the error came at once."""
    from sparcoll import worker as worker_module
    placing, finish = threading.Event(), worker_module._ResultPlacement.finish
    ended = []

    def slow_finish(self, message):     # still holding the tensor: its lease goes back in finish
        if self.job.rank == 0:
            placing.set()
            time.sleep(0.5)
            ended.append(time.monotonic())
        finish(self, message)
    monkeypatch.setattr(worker_module._ResultPlacement, "finish", slow_finish)

    def target(comm, rank):
        failed_at = []
        work = comm.allreduce(torch.ones(1 << 16), async_op=True)
        work.add_done_callback(lambda _: failed_at.append(time.monotonic()))
        if rank == 0:
            assert placing.wait(20)
            comm.close()
        outcome = outcome_of(lambda: work.wait(20))
        return outcome, failed_at

    results = in_threads(2, target, timeout=10.0, algorithm="sparse")
    outcome, failed_at = results[0]
    assert outcome[0] == "SparcollError" and "closed" in outcome[1], outcome
    assert ended and failed_at and min(ended) <= failed_at[0], (ended, failed_at)


def test_a_blocking_call_behind_a_longer_one_waits_for_that_ones_timeout(monkeypatch):
    """A blocking call with a short timeout queued behind an async one with a long timeout: its wait
    was bounded by (calls ahead + 1) times its own timeout (plus GRACE), so a peer late for the long
    call within that call's timeout made it raise CollectiveTimeout while still queued, after which
    it ran and wrote the tensor anyway. It now waits for the timeouts of the calls ahead."""
    from sparcoll import engine
    monkeypatch.setattr(engine, "GRACE", 0.1)

    def target(comm, rank):
        if rank == 1:
            time.sleep(2.0)         # late for the first call, within its timeout (5 s)
        first = comm.allreduce(torch.ones(5000), async_op=True, timeout=5.0)
        second = torch.full((3000,), float(rank + 1))
        comm.allreduce(second, timeout=0.5)     # its old bound: 2 x 0.6 s
        first.wait()
        return second.tolist() == [3.0] * 3000
    assert in_threads(2, target) == [True, True]


@pytest.mark.parametrize("algorithm", ["ring", "sparse"])
def test_a_works_deadline_counts_the_blocking_call_running_ahead_of_it_and_no_call_that_ended(algorithm):
    """A blocking call run on the caller's thread makes no Work, but the Works placed while it runs
    wait for it: their deadline counts its timeout (plus GRACE). Once calls end they count for
    nothing: a review's mutation that left each blocking call counted put an async call's deadline
    231 s away after 20 calls of 6 s, where it is 11 s (no test saw it)."""
    from sparcoll import engine

    def target(comm, rank):
        for _ in range(20):
            comm.allreduce(torch.ones(1000), timeout=6.0)
        after = comm.allreduce(torch.ones(1000), async_op=True, timeout=6.0)
        alone = after.deadline - time.monotonic()
        after.wait()
        if rank == 1:
            time.sleep(1.0)         # rank 0's blocking call below waits for it, on rank 0's thread
        placed = {}

        def place_behind():
            time.sleep(0.3)         # the blocking call has its id and runs
            placed["work"] = comm.allreduce(torch.ones(1000), async_op=True, timeout=6.0)
            placed["left"] = placed["work"].deadline - time.monotonic()
        behind = threading.Thread(target=place_behind, daemon=True)
        if rank == 0:
            behind.start()
        comm.allreduce(torch.ones(1000), timeout=4.0)
        if rank == 0:
            behind.join(20)
        else:
            placed["work"] = comm.allreduce(torch.ones(1000), async_op=True, timeout=6.0)
        placed["work"].wait()
        return alone, placed.get("left"), comm._engine._ahead_s
    (alone, left, ahead), (alone_1, _, ahead_1) = in_threads(2, target, algorithm=algorithm)
    assert 6.0 + engine.GRACE - 1 < alone <= 6.0 + engine.GRACE and alone_1 <= 6.0 + engine.GRACE, (alone, alone_1)
    # rank 0's async call was placed 0.3 s into its blocking call of 4 s: it waits for that one too
    assert 4.0 + 6.0 + 2 * engine.GRACE - 1.3 < left <= 4.0 + 6.0 + 2 * engine.GRACE, left
    assert abs(ahead) < 1e-6 and abs(ahead_1) < 1e-6, (ahead, ahead_1)


def test_a_wait_that_gives_up_at_the_deadline_keeps_its_collective_from_running_later(monkeypatch):
    """A done-callback that holds the engine thread (2 s) past the deadline of the blocking call
    queued behind it: that call raises CollectiveTimeout, and the communicator is poisoned, so the
    call never runs afterwards (before, it would sum into the tensor after its error)."""
    from sparcoll import engine
    monkeypatch.setattr(engine, "GRACE", 0.1)

    held = threading.Event()        # rank 0's callback is on before the call can complete

    def target(comm, rank):
        if rank == 1:
            assert held.wait(20)
        first = comm.allreduce(torch.ones(5000), async_op=True, timeout=1.0)
        if rank == 0:
            first.add_done_callback(lambda work: time.sleep(2.0))
            held.set()
        second = torch.full((3000,), float(rank + 1))
        outcome = outcome_of(lambda: comm.allreduce(second, timeout=0.5))
        time.sleep(2.5)             # the engine is free again: a late run would have written by now
        return outcome[0], second.tolist() == [float(rank + 1)] * 3000, comm._engine.poison is not None
    zero, _ = in_threads(2, target)
    assert zero == ("CollectiveTimeout", True, True), zero


def test_close_fails_the_async_calls_still_queued_without_running_them():
    """close() while one async call is in flight and another queued behind it: the queued one ran
    after close (scanning its tensor, sending to the aggregators) and its wait() ended at its
    timeout with a CollectiveTimeout. Now it fails at once as closed, its tensor untouched."""
    closed = threading.Event()

    def target(comm, rank):
        if rank == 1:               # never calls, and stays until rank 0 closed: its first call
            assert closed.wait(20)  # stays in flight
            return None
        try:
            first = comm.allreduce(torch.ones(5000), async_op=True)
            queued = torch.ones(3000)
            second = comm.allreduce(queued, async_op=True)
            time.sleep(0.2)
            start = time.monotonic()
            comm.close()
            closed_in = time.monotonic() - start
        finally:
            closed.set()
        outcome = outcome_of(lambda: second.wait())
        return closed_in, outcome[:2], torch.equal(queued, torch.ones(3000)), type(first.exception()).__name__
    closed_in, (kind, text), untouched, first = in_threads(2, target, timeout=20.0)[0]
    assert closed_in < 2.0 and kind == "SparcollError" and "closed" in text and untouched, \
        (closed_in, kind, text, untouched)
    assert first == "SparcollError", first


@pytest.mark.parametrize("algorithm", ["sparse", "ring"])
def test_close_during_collective_returns_and_fails_it(algorithm):
    """close() while a collective waits for a peer that never calls: on the sparse path and on
    gloo's ring (where it used to wait 5 s for the engine thread and return with that thread still
    in the collective, whose wait() then ended with a lost connection)."""
    done = threading.Event()

    def target(comm, rank):
        if rank == 1:                       # never calls: rank 0's collective stays in flight
            done.wait(20)
            return None
        try:
            checking = threading.Event()
            if algorithm == "ring":         # rank 0's round of the ring's check begins
                star = comm._engine.ring.star
                star.round = functools.partial(lambda begin, *args: checking.set() or begin(*args), star.round)
            work = comm.allreduce(torch.ones(1000), async_op=True)
            # In flight: its contribution to rank 1's aggregator has gone out, or its check round
            # on the ring has begun (it cannot finish, rank 1 never calls).
            in_flight = wait_for(lambda: comm.stats.messages_sent > 0 if algorithm == "sparse"
                                 else checking.is_set(), 10)
            t = time.monotonic()
            comm.close()
            closed_in = time.monotonic() - t
            return in_flight, outcome_of(lambda: work.wait(5)), closed_in, outcome_of(
                lambda: comm.allreduce(torch.ones(10))), comm._engine._thread.is_alive()
        finally:
            done.set()

    (in_flight, during, closed_in, after, engine_alive), _ = in_threads(2, target, timeout=30.0,
                                                                        algorithm=algorithm)
    assert in_flight, "rank 0 never sent its contribution"
    assert during[0] == "SparcollError" and "closed" in during[1], during
    assert closed_in < 2.0 and not engine_alive, (closed_in, engine_alive)
    assert after[0] == "SparcollError" and "closed" in after[1], after


def test_recreated_communicator_works_after_poisoning(store):
    results = [None, None]

    def run(rank):
        with Communicator(dist.PrefixStore("p1/", store), rank, 2, timeout=5.0) as comm:
            bad = outcome_of(lambda: comm.allreduce(torch.ones(1000 + rank)))
            poisoned = outcome_of(lambda: comm.allreduce(torch.ones(1000)))
        with Communicator(dist.PrefixStore("p2/", store), rank, 2, timeout=5.0) as comm:
            x = make_input(0, rank, 5000)
            comm.allreduce(x)
            results[rank] = bad, poisoned, torch.equal(x, expected(0, 2, 5000))
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for bad, poisoned, exact in results:
        assert bad[0] == "MismatchError" and poisoned[0] == "PoisonedError" and exact


def test_peer_rejects_input_and_leaves_before_this_rank_starts(store):
    """Rank 1 passes a meta tensor: it raises ValueError itself, tells its peers why, and leaves.
    Rank 0 calls the collective only after rank 1's report and its connection's end have both
    arrived: the peer's own report wins over the poison of that connection's end."""
    results = [None, None]
    left = threading.Event()

    def run(rank):
        try:
            with Communicator(dist.PrefixStore("e/", store), rank, 2, timeout=5.0) as comm:
                if rank == 1:
                    results[1] = outcome_of(lambda: comm.allreduce(torch.empty(1000, device="meta")),
                                            expected=(ValueError,))
                    return
                assert left.wait(20), "rank 1 never left"
                # Nothing public shows that rank 1's ERROR for collective 1 and its connection's
                # end have been processed here: poll the communicator's state for both.
                assert wait_for(lambda: comm._worker.early_error_soon(1)
                                and comm._engine.poison is not None, 10), \
                    "rank 1's report or its connection's end never arrived"
                results[0] = outcome_of(lambda: comm.allreduce(torch.ones(1000)))
        finally:
            if rank == 1:
                left.set()
    on_threads(run, 2)
    assert results[1][0] == "ValueError" and "meta" in results[1][1], results[1]
    kind, text, _ = results[0]
    assert kind == "SparcollError" and "rank 1" in text and "meta" in text, results[0]


@pytest.mark.parametrize("rank_0_attached", ["at once", "late"])
def test_internal_error_in_the_aggregator_fails_the_job_fast(monkeypatch, dedicated_in_process,
                                                             rank_0_attached):
    """An unexpected exception while serving a connection (here injected into contribute) closes that
    connection with a logged reason; every rank then raises a PeerError at once instead of waiting for
    its deadline, and the aggregator keeps serving new jobs. "late": rank 0's connection is attached
    to its job only after rank 1 failed and left (its handshake had ended; a loaded machine), and
    it still learns the reason: the job was kept for it (a CI run had seen "aggregator 0 closed
    the connection", the job forgotten when its only attached worker left)."""
    original = aggregator_module.AggregatorJob.contribute
    failed = threading.Event()

    def broken(self, rank, *args, **kwargs):
        if rank == 1:
            failed.set()
            raise RuntimeError("injected bug")
        return original(self, rank, *args, **kwargs)

    monkeypatch.setattr(aggregator_module.AggregatorJob, "contribute", broken)
    if rank_0_attached == "late":
        attend = server_module.AggregatorServer._attend

        def late(self, sock, hello):
            if hello.rank == 0:
                failed.wait(5.0)
                time.sleep(0.2)     # rank 1's connection ends meanwhile
            return attend(self, sock, hello)
        monkeypatch.setattr(server_module.AggregatorServer, "_attend", late)
    results = in_threads(2, lambda comm, rank: outcome_of(lambda: comm.allreduce(torch.ones(4096))),
                         aggregators=dedicated_in_process, timeout=10.0)
    for rank, (kind, text, seconds) in enumerate(results):
        # rank 0 learns which peer failed; rank 1 sees the aggregator close its connection
        assert kind == "PeerError" and ("rank 1" if rank == 0 else "aggregator 0") in text, \
            (rank, kind, text)
        assert seconds < 5.0, (rank, seconds)
    monkeypatch.undo()

    def exact(comm, rank):
        x = make_input(0, rank, 5000)
        comm.allreduce(x)
        return torch.equal(x, expected(0, 2, 5000))
    assert in_threads(2, exact, aggregators=dedicated_in_process) == [True, True]


def test_a_connection_lost_between_the_poison_check_and_the_collective_fails_it_at_once(monkeypatch):
    """The aggregator drops rank 0's connection once rank 0's collective has passed the engine's look
    for the poison, and the collective becomes active only after the loss (events order them: sleeps
    of 0.3 and 0.6 s did, which a busy machine could overturn). broken() found no active collective
    to fail and the collective waited for its deadline (20 s: the failure of the test below once in a
    suite run, and once before); it now fails at once with the lost connection."""
    from sparcoll import transport, worker
    from sparcoll.server import AggregatorServer
    original_connection, original_run = transport.Connection, worker.WorkerJob.run
    passed = threading.Event()      # rank 0's collective passed the look for the poison

    def late_refusal_of_rank_0(sock, peer, on_failure, *backlog):
        if peer.startswith("rank 0 of job"):
            passed.wait(20)
            raise RuntimeError("can't start new thread")
        return original_connection(sock, peer, on_failure, *backlog)

    def run_late_on_rank_0(self, coll, block_size):
        if self.rank == 0:
            passed.set()
            wait_for(lambda: self._lost is not None, 20)    # the connection is lost meanwhile
        return original_run(self, coll, block_size)

    server = AggregatorServer("127.0.0.1", 0, b"")
    try:
        monkeypatch.setattr(transport, "Connection", late_refusal_of_rank_0)
        monkeypatch.setattr(worker.WorkerJob, "run", run_late_on_rank_0)
        results = in_threads(2, lambda comm, rank: outcome_of(lambda: comm.allreduce(torch.ones(4096))),
                             aggregators=[server.address], timeout=20.0)
        kind, text, seconds = results[0]
        assert kind == "PeerError" and seconds < 5.0, results
    finally:
        monkeypatch.undo()
        server.close()


def test_a_connection_the_aggregator_cannot_serve_fails_its_job_at_once(monkeypatch):
    """The thread that sends a worker its results may not start (out of threads, in a flood): the
    rank's place in its job is freed and its peers' collectives fail at once, naming it, instead of
    waiting for their deadline, and the job is forgotten; the server goes on serving."""
    from sparcoll import transport
    from sparcoll.server import AggregatorServer
    original = transport.Connection

    def no_thread_for_rank_0(sock, peer, on_failure, *backlog):
        if peer.startswith("rank 0 of job"):
            raise RuntimeError("can't start new thread")
        return original(sock, peer, on_failure, *backlog)

    server = AggregatorServer("127.0.0.1", 0, b"")
    try:
        monkeypatch.setattr(transport, "Connection", no_thread_for_rank_0)
        start = time.monotonic()
        results = in_threads(2, lambda comm, rank: outcome_of(lambda: comm.allreduce(torch.ones(4096))),
                             aggregators=[server.address], timeout=20.0)
        assert time.monotonic() - start < 10.0, results
        # each rank learns why: in its collective, or in init (rank 0 told by the aggregator, rank 1
        # by the aggregator or by rank 0's announcement that it gave up init)
        for rank, result in enumerate(results):
            kind, text = (type(result).__name__, str(result)) if isinstance(result, BaseException) \
                else result[:2]
            assert kind == "PeerError" or rank == 0 and kind == "PoisonedError", (rank, result)
            assert "rank 0: the aggregator could not serve its connection" in text, result
        assert wait_for(lambda: not server.jobs, 10), server.jobs
        monkeypatch.undo()

        def exact(comm, rank):
            x = make_input(0, rank, 5000)
            comm.allreduce(x)
            return torch.equal(x, expected(0, 2, 5000))
        assert in_threads(2, exact, aggregators=[server.address]) == [True, True]
    finally:
        server.close()


# ---- a lost connection and the report of why ----------------------------------------------------

def _waiting_job():
    """A WorkerJob (only its failure handling) whose collective 7 waits for aggregators 0 and 1."""
    from sparcoll.collective import WorkerCollective
    from sparcoll.worker import WorkerJob
    job = object.__new__(WorkerJob)     # no connections: only broken() and collective_error()
    job.rank, job.addresses, job._on_poison = 1, ["127.0.0.1:1", "127.0.0.1:2"], lambda exc: None
    job._lock, job._finished_through, job._early_errors = threading.Lock(), 6, {}
    job._early_reported, job._report_due, job._lost = threading.Condition(job._lock), 0.0, None
    coll = WorkerCollective(7, torch.zeros(512), (512, 0, 0), timeout=10.0)
    coll.start(256, [(0, 0, None, None), (1, 0, None, None)])
    job._active = coll
    return job, coll


def test_reports_of_collectives_not_yet_run_are_kept_bounded_the_lowest_ids_first():
    """A peer holding the secret can make its aggregator relay an ERROR for any number of future
    collective ids (on the code before, every one was kept until this rank ran it: 5,000 here).
    At most EARLY_ERRORS are kept, the lowest ids, which come next; a collective this rank ran to
    its end, on any path (gloo's ring too), drops the reports of it and of every one before it."""
    from sparcoll import wire, worker
    job, _ = _waiting_job()
    ids = list(range(8, 5008))
    random.Random(0).shuffle(ids)
    for cid in ids:
        job.collective_error(wire.Failure(cid, wire.ErrorCode.GENERIC, f"rank 0: refused {cid}"))
    assert sorted(job._early_errors) == list(range(8, 8 + worker.EARLY_ERRORS))
    assert "refused 8" in str(job.take_early_error(8))
    job.finished(20)
    assert sorted(job._early_errors) == list(range(21, 8 + worker.EARLY_ERRORS))
    job.collective_error(wire.Failure(15, wire.ErrorCode.GENERIC, "rank 0: too late"))
    assert 15 not in job._early_errors


def test_a_lost_aggregator_gives_way_to_the_peers_report_that_follows(monkeypatch):
    """A peer that refused its input announces it and leaves: its aggregator's closed connection
    may reach this rank first (seen under load). The report that follows within REPORT_GRACE (3 s
    here, so that a busy machine cannot make the report 50 ms later come after it) is the error
    the collective fails with."""
    from sparcoll import wire, worker
    from sparcoll.errors import PeerError
    monkeypatch.setattr(worker, "REPORT_GRACE", 3.0)
    job, coll = _waiting_job()
    lost = threading.Thread(target=job.broken,
                            args=(0, PeerError("aggregator 0 at 127.0.0.1:1 closed the connection")))
    lost.start()
    time.sleep(0.05)
    job.collective_error(wire.Failure(7, wire.ErrorCode.GENERIC, "rank 0: op max is not supported"))
    lost.join(timeout=5.0)
    assert not lost.is_alive()
    assert "op max" in str(coll.error), coll.error


def test_a_lost_aggregator_without_a_report_fails_the_collective_after_the_grace():
    from sparcoll.errors import PeerError
    job, coll = _waiting_job()
    start = time.monotonic()
    job.broken(0, PeerError("aggregator 0 at 127.0.0.1:1 closed the connection"))
    elapsed = time.monotonic() - start
    assert isinstance(coll.error, PeerError) and "closed the connection" in str(coll.error)
    assert REPORT_GRACE * 0.9 <= elapsed < REPORT_GRACE + 2.0, elapsed


def _poisoned_engine():
    """An Engine over a WorkerJob (only its failure handling) that has started collective 7 and
    nothing since; the job's lost connections poison the engine, as in a Communicator."""
    from sparcoll.algorithm import Algorithm, Chooser
    from sparcoll.engine import Engine
    job, _ = _waiting_job()
    job._active = None                  # collective 7 is over; 8 is this rank's next
    engine = Engine(1, job, Chooser(Algorithm.SPARSE, 256, 2), ring=None)
    job._on_poison = engine.set_poison
    return job, engine


@pytest.mark.parametrize("started", [False, True])
def test_a_call_after_a_lost_aggregator_fails_with_the_peers_report_that_follows(started, monkeypatch):
    """A peer refused its input for collective 8 and left; its closed connection reached this rank
    before its report, and this rank calls collective 8 meanwhile. Whether the call is checked on
    submission or already queued when the report comes, it fails with the report (within
    REPORT_GRACE of the lost connection: 3 s here, so that a busy machine cannot make the report
    0.1 s later come after it), not with the lost connection."""
    from sparcoll import wire, worker
    from sparcoll.collective import WorkerCollective
    from sparcoll.errors import PeerError, PoisonedError
    monkeypatch.setattr(worker, "REPORT_GRACE", 3.0)
    job, engine = _poisoned_engine()
    try:
        lost_at = time.monotonic()
        job.broken(0, PeerError("aggregator 0 at 127.0.0.1:1 closed the connection"))
        report = threading.Timer(0.1, job.collective_error,
                                 (wire.Failure(8, wire.ErrorCode.GENERIC,
                                               "rank 0: op max is not supported"),))
        report.start()
        coll = WorkerCollective(8, torch.zeros(512), (512, 0, 0), timeout=10.0)
        if not started:
            engine.check_poison(8)      # raises PoisonedError without the wait
        error = engine._execute(coll)
        report.join(timeout=5.0)
        assert "op max" in str(error) and not isinstance(error, PoisonedError), error
        assert time.monotonic() - lost_at < worker.REPORT_GRACE
    finally:
        engine.close()


def test_a_call_after_a_lost_aggregator_without_a_report_is_poisoned_after_the_grace_only(monkeypatch):
    """No report comes: the first call waits until REPORT_GRACE (2 s here) after the lost
    connection, then fails as poisoned; a call after that grace fails at once."""
    from sparcoll import worker
    from sparcoll.errors import PeerError, PoisonedError
    monkeypatch.setattr(worker, "REPORT_GRACE", 2.0)
    job, engine = _poisoned_engine()
    try:
        lost_at = time.monotonic()
        job.broken(0, PeerError("aggregator 0 at 127.0.0.1:1 closed the connection"))
        with pytest.raises(PoisonedError, match="closed the connection"):
            engine.check_poison(8)
        assert 0.9 * 2.0 <= time.monotonic() - lost_at < 2.0 + 1.0
        start = time.monotonic()
        with pytest.raises(PoisonedError, match="closed the connection"):
            engine.check_poison(9)
        assert time.monotonic() - start < 1.0
    finally:
        engine.close()
