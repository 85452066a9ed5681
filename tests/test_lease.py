"""Buffer lifetimes and state changes, without sockets: a Lease comes back exactly once, Loans wait
for every lease, and a worker's collective moves only along its allowed states."""
import threading
import time

import numpy as np
import pytest
import torch

from sparcoll.collective import CollectiveState, WorkerCollective
from sparcoll.errors import CollectiveTimeout, PeerError
from sparcoll.lease import Lease, Loans, give_back
from sparcoll.lifecycle import IllegalTransition


def test_lease_returns_once_after_every_holder_from_many_threads():
    returned = []
    lease = Lease(lambda: returned.append(1), count=64)
    barrier = threading.Barrier(8)

    def holders():
        barrier.wait(10)
        for _ in range(8):
            lease.give_back()
    threads = [threading.Thread(target=holders) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert returned == [1]
    lease.give_back()                       # one too many: ignored, never a second return
    assert returned == [1]


def test_lease_for_no_holders_returns_at_once_and_shared_leases_chain():
    returned = []
    Lease(lambda: returned.append("empty"), count=0)
    assert returned == ["empty"]
    inner = Lease(lambda: returned.append("inner"))
    shared = Lease.shared(inner, 3)
    for _ in range(2):
        shared.give_back()
    assert returned == ["empty"]            # two of three holders are done: not yet
    shared.give_back()
    assert returned == ["empty", "inner"]
    assert Lease.shared(None, 3) is None    # memory lent without a lease needs none shared
    give_back(None)


def test_loans_wait_until_every_lease_is_back():
    loans = Loans()
    assert loans.wait(0)                    # nothing lent
    first, second = loans.lend(), loans.lend()
    assert not loans.wait(0)
    first.give_back()
    assert not loans.wait(0)
    waiter_saw = []
    waiter = threading.Thread(target=lambda: waiter_saw.append(loans.wait(30)))
    waiter.start()
    second.give_back()
    waiter.join(30)
    assert waiter_saw == [True]


def collective(numel=1000, timeout=5.0):
    return WorkerCollective(1, torch.ones(numel), (numel, 0, 0), timeout)


RANGES = [(0, 0, 0, 2), (1, 0, 2, 4)]   # (aggregator, stream, lo, hi)


def test_collective_states_from_queued_to_done():
    coll = collective()
    assert coll.state.state is CollectiveState.QUEUED
    coll.start(256, RANGES)
    assert coll.state.state is CollectiveState.STREAMING and not coll.settled.is_set()
    lease = coll.loans.lend()               # the own aggregator still holds the tensor
    assert coll.waiting_for() == [0, 1]
    coll.stream_done((0, 0))
    assert coll.state.state is CollectiveState.STREAMING and coll.waiting_for() == [1]
    coll.stream_done((1, 0))
    assert coll.waiting_for() == []
    assert coll.state.state is CollectiveState.DRAINING and coll.settled.is_set()
    coll.fail(PeerError("late report"))     # all results are in: a late report changes nothing
    assert coll.state.state is CollectiveState.DRAINING and coll.error is None
    lease.give_back()
    coll.drain(time.monotonic() + 5, rank=0)
    assert coll.state.state is CollectiveState.DONE and coll.error is None


def test_collective_fails_once_and_drain_times_out_into_failed():
    coll = collective()
    coll.start(256, RANGES)
    first, second = PeerError("first"), PeerError("second")
    coll.fail(first)
    coll.fail(second)
    assert coll.state.state is CollectiveState.FAILED and coll.error is first
    coll.stream_done((0, 0))
    coll.stream_done((1, 0))                # results after a failure do not revive it
    assert coll.state.state is CollectiveState.FAILED

    stuck = collective(timeout=0.01)
    stuck.start(256, RANGES)
    stuck.loans.lend()                      # never given back
    stuck.stream_done((0, 0))
    stuck.stream_done((1, 0))
    stuck.drain(time.monotonic(), rank=3)
    assert stuck.state.state is CollectiveState.FAILED
    assert isinstance(stuck.error, CollectiveTimeout) and "rank 3" in str(stuck.error)


def test_illegal_moves_are_refused():
    coll = collective()
    with pytest.raises(IllegalTransition, match="QUEUED -> DONE"):
        coll.state.move(CollectiveState.DONE)
    coll.start(256, RANGES)
    with pytest.raises(IllegalTransition, match="STREAMING -> STREAMING"):
        coll.start(256, RANGES)
    coll.fail(PeerError("x"))
    for state in CollectiveState:
        with pytest.raises(IllegalTransition):   # FAILED is final
            coll.state.move(state)


def test_sparse_collective_result_replaces_the_tensor():
    coo = torch.sparse_coo_tensor(torch.tensor([[3, 700]]), torch.tensor([1.0, 2.0]), (1000,),
                                  check_invariants=True)
    coll = WorkerCollective(1, coo, (1000, 0, 0), 5.0)
    coll.start(256, [(0, 0, 0, 4)])
    assert np.array_equal(coll.blocks.nonzero(0, 4), [0, 2])
    coll.stream_done((0, 0))
    assert coll.tensor.layout == torch.sparse_coo and coll.tensor is not coo


def _job_with_local_workers(world: int = 2):
    """An aggregator's job (aggregator 0 of 1, one stream, blocks of 4) whose workers are queues."""
    from sparcoll import wire
    from sparcoll.aggregator import AggregatorJob, LocalWorker
    job = AggregatorJob(1, 0, wire.JobConfig(world, 1, 1, 2, 4), b"t" * 32)
    inboxes = [[] for _ in range(world)]
    for rank in range(world):
        job.attach(rank, LocalWorker(inboxes[rank].append))

    def contribute(rank, rows, lease):
        header = wire.Header(wire.Kind.CONTRIBUTE, 0, 1, 7, 0, rows.shape[0], 3, 12, 4, 0, 0, 0)
        job.contribute(rank, header, np.array([0, 1, 2]), rows, lease, reuse=2)
    return job, inboxes, contribute


def test_a_failed_collective_gives_back_what_the_aggregator_held_of_it():
    from sparcoll import wire
    job, inboxes, contribute = _job_with_local_workers()
    loans = Loans()
    contribute(0, torch.ones(3, 4), loans.lend())
    assert not loans.wait(0)                    # rank 0's rows wait for rank 1's
    job.fail(7, wire.ErrorCode.PEER, "rank 1 left")
    assert loans.wait(0)
    late = loans.lend()
    contribute(1, torch.ones(3, 4), late)       # a late contribution to it: let go at once
    assert loans.wait(0)
    assert all(isinstance(inbox[-1], wire.Failure) for inbox in inboxes)


def test_a_shard_names_the_ranks_it_waits_for_and_still_does_while_and_after_it_fails():
    """What a collective's timeout names (worker._describe_stall): rank 1 finished stream 1 and sent
    nothing of stream 0, so it sent part of it (it read "sent nothing": a review); rank 2 nothing.
    While a failure waits for the shard's lock, and after it, the same (a review: in that window
    the shard was gone and its record not yet written, and the timeout named nobody)."""
    from sparcoll import wire
    from sparcoll.aggregator import AggregatorJob, LocalWorker
    job = AggregatorJob(1, 0, wire.JobConfig(3, 1, 2, 2, 4), b"t" * 32)      # 8 blocks: streams [0, 4), [4, 8)
    for rank in range(3):
        job.attach(rank, LocalWorker(lambda message: None))

    def finish(rank, stream):
        header = wire.Header(wire.Kind.CONTRIBUTE, stream, 1, 7, 0, 0, 4 * (stream + 1), 32, 4, 0, 0, 0)
        job.contribute(rank, header, np.array([], dtype=np.int64), torch.ones(0, 4))
    for rank, stream in ((0, 0), (0, 1), (1, 1)):
        finish(rank, stream)
    expected = {1: False, 2: True}
    assert job.holding_back(7) == expected
    shard = job._collectives[7]
    with shard.lock:        # as a contribution being summed holds it
        failing = threading.Thread(target=job.fail, args=(7, wire.ErrorCode.PEER, "rank 0 left"), daemon=True)
        failing.start()
        time.sleep(0.2)
        assert job.holding_back(7) == expected
    failing.join(10)
    assert not failing.is_alive() and 7 not in job._collectives
    assert job.holding_back(7) == expected


def test_a_rank_attached_after_its_collective_failed_is_told_why_at_its_first_message():
    """A dedicated aggregator may attach a rank's connection after the rank's handshake ended: a
    failure sent meanwhile missed it, and its contribution to the failed collective must bring the
    error back (once), not be dropped silently while the rank waits for its timeout."""
    from sparcoll import wire
    from sparcoll.aggregator import AggregatorJob, LocalWorker
    job = AggregatorJob(1, 0, wire.JobConfig(2, 1, 1, 2, 4), b"t" * 32)
    inboxes = [[], []]
    job.attach(1, LocalWorker(inboxes[1].append))
    header = wire.Header(wire.Kind.CONTRIBUTE, 0, 1, 7, 0, 3, 3, 12, 4, 0, 0, 0)
    job.contribute(1, header, np.array([0, 1, 2]), torch.ones(3, 4))
    job.detach(1, (wire.ErrorCode.PEER, "rank 1 died"))
    assert inboxes[1] == []                     # detached first: nobody was told
    job.attach(0, LocalWorker(inboxes[0].append))
    for _ in range(2):
        job.contribute(0, header, np.array([0, 1, 2]), torch.ones(3, 4))
    assert inboxes[0] == [wire.Failure(7, wire.ErrorCode.PEER, "rank 1 died")]


def test_a_rank_released_from_a_collective_gets_its_memory_back_and_the_others_still_complete():
    job, inboxes, contribute = _job_with_local_workers()
    loans, mine = Loans(), torch.ones(3, 4)
    contribute(0, mine, loans.lend())
    job.release(0, 7)
    assert loans.wait(0)
    mine.fill_(5)                               # rank 0 writes its tensor after giving up
    contribute(1, torch.full((3, 4), 2.0), None)
    result = inboxes[1][-1].result
    torch.testing.assert_close(result.rows, torch.full((3, 4), 3.0))
    assert torch.equal(mine, torch.full((3, 4), 5.0))


def test_a_contribution_waiting_for_a_collective_that_fails_meanwhile_is_let_go():
    """A contribution that found the collective in progress, then waited for its lock while the
    collective failed, is given back, not kept in a dropped shard (its owner would wait for it)."""
    from sparcoll import wire
    job, _, contribute = _job_with_local_workers()
    contribute(0, torch.ones(3, 4), None)           # the collective exists
    shard = job._collectives[7]
    lock, arrived = shard.lock, threading.Event()

    class Announced:        # the shard's lock, saying when a thread starts waiting for it
        def __enter__(self):
            arrived.set()
            return lock.__enter__()

        def __exit__(self, *exc):
            return lock.__exit__(*exc)
    loans = Loans()
    with lock:
        shard.lock = Announced()
        waiting = threading.Thread(target=contribute, args=(1, torch.ones(3, 4), loans.lend()))
        waiting.start()
        assert arrived.wait(10)
        shard.lock = lock
        job.fail(7, wire.ErrorCode.PEER, "rank 0 left")    # the same thread: the lock is reentrant
    waiting.join(10)
    assert not waiting.is_alive()
    assert loans.wait(0)
