"""An arbitrary exception (not one of sparcoll's) injected at each step of a collective on one rank.

Two colocated ranks in one process, each on its own thread. The injection hits only the victim's
objects (its tensor, its connections, its worker, its own aggregator). Every rank must raise a
SparcollError promptly (well before the deadline), the injected error must reach some rank's message,
later calls must fail at once (poisoned, never hang), close() must return, no thread may die with an
unhandled exception, and no thread of the job may outlive close()."""
from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

import sparcoll
from sparcoll import aggregator, collective, protocol, transport, wire, worker
from sparcoll.communicator import Communicator
from support import error_chain, on_threads, wait_for

TIMEOUT = 30.0          # the communicators' deadline
PROMPT = 10.0           # "at once": far below the deadline, generous for a loaded machine
NUMEL = 256 * 4096      # 10% of the blocks at random: > 32 runs per message, so gather and scatter run
STEPS = ["scan", "gather", "send", "receive", "scatter", "sum", "result", "local-result"]


class Injected(Exception):
    """Not a SparcollError: what a bug or a library underneath might raise."""


def sparse_input(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(1, 5, (NUMEL // 256, 256), generator=g).float()
    x[torch.rand(NUMEL // 256, generator=g) > 0.1] = 0.0
    return x.view(-1)


def inject(monkeypatch, step: str, victim: Communicator, tensor: torch.Tensor) -> None:
    """Make the victim's `step` raise Injected (every time it is reached)."""
    job, local_job = victim._worker, victim._worker.local_job
    ptr = tensor.data_ptr()

    def raising(original, hits):
        def patched(self, *args, **kwargs):
            if hits(self, *args):
                raise Injected(f"injected at {step}")
            return original(self, *args, **kwargs)
        return patched

    def patch(owner, name, hits):
        monkeypatch.setattr(owner, name, raising(getattr(owner, name), hits))

    victims_tensor = lambda self, *args: self.flat.data_ptr() == ptr       # noqa: E731
    if step == "scan":
        patch(collective.BlockTensor, "nonzero", victims_tensor)
    elif step == "gather":
        patch(collective.BlockTensor, "gather", victims_tensor)
    elif step == "scatter":
        patch(collective.BlockTensor, "scatter", victims_tensor)
    elif step == "send":
        patch(transport.Connection, "send", lambda self, buffers, *a: (
            self in job.connections.values() and _kind(buffers) == wire.Kind.CONTRIBUTE))
    elif step == "receive":
        patch(worker._ResultPlacement, "place", lambda self, *a: self.job is job)
    elif step == "sum":
        inside = threading.local()      # _sum does not know its job: mark the victim aggregator's calls
        contribute = aggregator.AggregatorJob.contribute

        def marked(self, *args, **kwargs):
            inside.victim = self is local_job
            try:
                return contribute(self, *args, **kwargs)
            finally:
                inside.victim = False
        monkeypatch.setattr(aggregator.AggregatorJob, "contribute", marked)
        patch(protocol.AggregatorStream, "_sum", lambda self, *a: getattr(inside, "victim", False))
    elif step == "result":
        patch(aggregator.AggregatorJob, "_broadcast", lambda self, *a: self is local_job)
    elif step == "local-result":
        patch(worker.WorkerJob, "_on_local_result", lambda self, *a: self is job)
    else:
        raise AssertionError(step)


def _kind(buffers) -> int:
    return bytes(memoryview(buffers[0]).cast("B")[5:6])[0]


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("victim_rank", [0, 1])
def test_an_exception_at_any_step_fails_every_rank_promptly(monkeypatch, store, step, victim_rank):
    unhandled = []
    monkeypatch.setattr(threading, "excepthook", lambda args: unhandled.append(
        f"{args.thread.name if args.thread else '?'}: {args.exc_type.__name__}: {args.exc_value}"))
    before = set(threading.enumerate())
    prefix = f"inject/{step}/{victim_rank}/"
    comms: dict[int, Communicator] = {}
    on_threads(lambda rank: comms.__setitem__(rank, Communicator(
        dist.PrefixStore(prefix, store), rank, 2, timeout=TIMEOUT, message_blocks=64)), 2)
    try:
        inputs = {rank: sparse_input(rank) for rank in range(2)}
        reference = inputs[0] + inputs[1]
        warmed = {}                 # the job works before the injection
        on_threads(lambda rank: warmed.__setitem__(
            rank, torch.equal(comms[rank].allreduce(inputs[rank].clone()), reference)), 2)
        assert warmed == {0: True, 1: True}
        inject(monkeypatch, step, comms[victim_rank], inputs[victim_rank])
        outcomes: dict[int, tuple] = {}

        def run(rank):
            t = time.monotonic()
            try:
                comms[rank].allreduce(inputs[rank])
                outcomes[rank] = ("NO ERROR", "", time.monotonic() - t)
            except sparcoll.SparcollError as exc:
                outcomes[rank] = (type(exc).__name__, error_chain(exc), time.monotonic() - t)
            except BaseException as exc:
                outcomes[rank] = ("UNEXPECTED " + type(exc).__name__, error_chain(exc),
                                  time.monotonic() - t)
            t = time.monotonic()
            try:
                comms[rank].allreduce(torch.ones(1000))
                then = "NO ERROR"
            except sparcoll.SparcollError as exc:
                then = type(exc).__name__
            outcomes[rank] += (then, time.monotonic() - t)
        on_threads(run, 2, timeout=3 * TIMEOUT)
        for rank, (kind, text, seconds, then, then_s) in outcomes.items():
            assert kind != "NO ERROR" and not kind.startswith("UNEXPECTED"), (rank, kind, text)
            assert seconds < PROMPT, (rank, kind, text, seconds)
            assert then == "PoisonedError" and then_s < PROMPT, (rank, then, then_s)
        assert any("Injected" in text for _, text, *_ in outcomes.values()), outcomes
    finally:
        for rank in range(2):
            if rank in comms:
                t = time.monotonic()
                comms[rank].close()
                assert time.monotonic() - t < PROMPT
    assert wait_for(lambda: not (set(threading.enumerate()) - before), 10), \
        [t.name for t in set(threading.enumerate()) - before]
    assert not unhandled, unhandled
