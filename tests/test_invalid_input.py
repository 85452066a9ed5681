"""Input the scan cannot read as it is, and the smaller misuses: each handled before anything is sent,
with a clear error on the rank that made the mistake and, at once, on its peers; or, where gloo
accepts it, reduced as gloo does. Two colocated ranks on threads of this process."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import sparcoll
from sparcoll.communicator import Communicator
from support import on_threads

TIMEOUT = 20.0
PROMPT = 8.0            # "at once": far below the deadline


def pair(store, prefix: str, **options) -> dict[int, Communicator]:
    comms: dict[int, Communicator] = {}
    on_threads(lambda rank: comms.__setitem__(rank, Communicator(
        dist.PrefixStore(prefix, store), rank, 2, timeout=TIMEOUT, **options)), 2)
    return comms


def close(comms) -> None:
    for comm in comms.values():
        comm.close()


def on_both(comms, call) -> dict[int, tuple]:
    """call(rank, comm) on both ranks at once: (outcome, seconds) per rank."""
    out: dict[int, tuple] = {}

    def run(rank):
        t = time.monotonic()
        try:
            out[rank] = (call(rank, comms[rank]), time.monotonic() - t)
        except Exception as exc:
            out[rank] = (exc, time.monotonic() - t)
    on_threads(run, 2, timeout=3 * TIMEOUT)
    return out


def test_tensors_that_require_grad_are_reduced_in_place_like_gloo(store):
    comms = pair(store, "grad/")
    try:
        leaves = {r: torch.full((1000,), float(r + 1), requires_grad=True) for r in range(2)}
        out = on_both(comms, lambda r, c: c.allreduce(leaves[r]))
        for r in range(2):
            result, _ = out[r]
            assert result is leaves[r] and result.requires_grad
            assert torch.equal(leaves[r].detach(), torch.full((1000,), 3.0))
        # A non-leaf (a loss) and the async form, as logging code does.
        losses = {r: (torch.ones(300, requires_grad=True) * (r + 2)) for r in range(2)}
        out = on_both(comms, lambda r, c: c.allreduce(losses[r], async_op=True).wait())
        for r in range(2):
            assert torch.equal(losses[r].detach(), torch.full((300,), 5.0))
        grads = {r: torch.sparse_coo_tensor(torch.tensor([[r, 7]]), torch.tensor([1.0, 2.0]), (10,),
                                            requires_grad=True, check_invariants=True)
                 for r in range(2)}
        out = on_both(comms, lambda r, c: c.allreduce_coo(grads[r]))
        dense = torch.zeros(10)
        dense[0], dense[1], dense[7] = 1.0, 1.0, 4.0
        for r in range(2):
            assert torch.equal(out[r][0].to_dense(), dense)
    finally:
        close(comms)


@pytest.mark.parametrize("algorithm", ["sparse", "ring", "auto"])
def test_inference_tensors_are_reduced_in_place_on_every_path(store, algorithm):
    """A metric made under torch.inference_mode (a validation loop), reduced there or after: on the
    sparse path the result's in-place writes, on threads outside inference mode, raised "Inplace
    update to inference tensor outside InferenceMode" and poisoned the communicator (a review);
    gloo reduces it. Sizes of the tiny check round, the gathered path and the data allreduce."""
    comms = pair(store, f"inference-{algorithm}/", algorithm=algorithm)
    try:
        for inside in (True, False):
            for numel in (100, 3000, 200_000):
                with torch.inference_mode():
                    xs = {r: torch.arange(numel, dtype=torch.float32) * (r + 1) for r in range(2)}
                want = (xs[0] + xs[1]) / 2

                def call(r, c):
                    with torch.inference_mode(inside):
                        return c.allreduce(xs[r], op="avg")
                out = on_both(comms, call)
                for r in range(2):
                    assert out[r][0] is xs[r], (inside, numel, r, out[r])
                    assert torch.equal(xs[r], want), (inside, numel, r)
    finally:
        close(comms)


@pytest.mark.parametrize("make", [
    lambda: torch.ones(1).expand(1000),
    lambda: torch.ones(10, 1).expand(10, 100),
    lambda: torch.ones(2, 50).as_strided((4, 50), (0, 1)),
], ids=["expand", "expand-2d", "as_strided"])
def test_overlapping_memory_is_refused_on_its_rank_and_reported_to_the_peer(store, make):
    comms = pair(store, f"overlap/{id(make)}/")
    try:
        out = on_both(comms, lambda r, c: c.allreduce(make() if r == 1 else torch.ones(1000)))
        error, seconds = out[1]
        assert isinstance(error, ValueError) and "share memory" in str(error), error
        peer_error, peer_seconds = out[0]
        assert isinstance(peer_error, sparcoll.SparcollError), peer_error
        assert "rank 1" in str(peer_error) and "share memory" in str(peer_error), peer_error
        assert seconds < PROMPT and peer_seconds < PROMPT, (seconds, peer_seconds)
    finally:
        close(comms)


def test_a_refused_input_behind_queued_calls_leaves_them_to_run_and_tells_the_peer_at_once(store):
    """Rank 1 queues four valid async calls, then one of a dtype sparcoll refuses, then a valid one;
    rank 0 makes six valid calls. The communicator was poisoned at the refusal: rank 1's queued
    calls failed with PoisonedError, unannounced, and rank 0 waited for them until its timeout (a
    review). Now they run and are exact on both ranks, the refusal reaches rank 0 when its turn
    comes, and the call after it fails on both."""
    comms = pair(store, "queued-refusal/")
    tensors = [torch.randn(1 << 20, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def calls(rank, comm):
        works = [comm.allreduce(t.clone(), async_op=True) for t in tensors]
        outcomes = []
        try:
            comm.allreduce(torch.ones(8, dtype=torch.int64) if rank == 1 else torch.ones(8), async_op=True).wait()
        except Exception as exc:
            outcomes.append(exc)
        try:
            comm.allreduce(torch.ones(8))
        except Exception as exc:
            outcomes.append(exc)
        return [w.wait() for w in works], outcomes
    try:
        out = on_both(comms, calls)
    finally:
        close(comms)
    for rank in (0, 1):
        (results, (refused, after)), seconds = out[rank]
        assert all(torch.equal(r, 2 * t) for r, t in zip(results, tensors)), rank
        if rank == 1:
            assert isinstance(refused, TypeError) and "dtype torch.int64" in str(refused), refused
        else:
            assert isinstance(refused, sparcoll.SparcollError) and "rank 1" in str(refused) \
                and "rejected its input" in str(refused), refused
        assert isinstance(after, sparcoll.PoisonedError), after
        assert seconds < PROMPT, (rank, seconds)


def test_two_threads_of_a_rank_calling_at_once_run_in_the_order_of_their_ids(store):
    """Rank 0's calls come from two threads: the first takes its id and is slow to put it in line
    (here its poison check takes 0.5 s), the second calls meanwhile. The second ran first, on its own
    thread, while rank 1 ran the first: each waited for the other until the timeout (a review). Now
    the ids go in line in order and both sums are exact."""
    comms = pair(store, "two-threads/")
    check_poison = comms[0]._engine.check_poison
    taken = threading.Event()       # the first call has its id

    def slow_for_the_first(cid):
        if not taken.is_set():
            taken.set()
            time.sleep(0.5)
        check_poison(cid)
    comms[0]._engine.check_poison = slow_for_the_first
    first, second = torch.randn(4096), torch.randn(4096)

    def calls(rank, comm):
        if rank == 1:
            return [comm.allreduce(first.clone(), tag=1), comm.allreduce(second.clone(), tag=2)]
        got = {}

        def second_call():
            taken.wait(TIMEOUT)
            got[2] = comm.allreduce(second.clone(), tag=2)
        other = threading.Thread(target=second_call)
        other.start()
        got[1] = comm.allreduce(first.clone(), tag=1)
        other.join(3 * TIMEOUT)
        return [got[1], got.get(2)]
    try:
        out = on_both(comms, calls)
    finally:
        close(comms)
    for rank in (0, 1):
        results, seconds = out[rank]
        assert not isinstance(results, Exception), (rank, results)
        assert torch.equal(results[0], 2 * first) and torch.equal(results[1], 2 * second), rank
        assert seconds < PROMPT, (rank, seconds)


def test_a_communicator_dropped_while_its_work_is_pending_lives_until_the_work_is_done(store):
    """A helper that starts an async allreduce and returns only its Work: the communicator, dropped,
    was collected and closed, and the Work failed with "the communicator was closed before the
    collective ran" on a rank that never closed it (a review). torch's Work keeps its group alive; so
    does sparcoll's now, until it is done."""
    import gc
    import weakref
    comms = pair(store, "dropped-pending/")
    tensor = torch.randn(4096)

    def calls(rank, comm):
        if rank == 1:
            time.sleep(0.3)         # rank 0's communicator is dropped meanwhile
            return comm.allreduce(tensor.clone())
        work, dropped = comm.allreduce(tensor.clone(), async_op=True), weakref.ref(comm)
        del comm, comms[0]
        gc.collect()
        result = work.wait()
        del work
        gc.collect()
        return result, dropped() is None
    try:
        out = on_both(comms, calls)
    finally:
        close(comms)
    (result, collected), _ = out[0]
    assert torch.equal(result, 2 * tensor) and torch.equal(out[1][0], 2 * tensor)
    assert collected        # and once its Work is done, the communicator goes


def test_a_non_contiguous_tensor_without_overlap_is_reduced(store):
    comms = pair(store, "strided/")
    try:
        bases = {r: torch.arange(2000, dtype=torch.float32).view(40, 50) * (r + 1) for r in range(2)}
        views = {r: bases[r].t()[::2] for r in range(2)}     # strided, no shared memory
        expected = (views[0] + views[1]).clone()
        on_both(comms, lambda r, c: c.allreduce(views[r]))
        for r in range(2):
            assert torch.equal(views[r], expected)
    finally:
        close(comms)


def test_a_sparse_tensor_of_more_blocks_than_the_indices_number_is_refused_on_every_rank(store):
    """A COO tensor of 2^42 rows once had its block indices wrap at int32: one rank's sum came back
    right, its peer's failed ("block indices not strictly increasing")."""
    comms = pair(store, "indices/")
    try:
        rows = 1 << 42
        out = on_both(comms, lambda r, c: c.allreduce_coo(torch.sparse_coo_tensor(
            torch.tensor([[r, rows - 1]]), torch.tensor([1.0, 2.0]), (rows,), check_invariants=True)))
        for r in range(2):
            error, seconds = out[r]
            assert isinstance(error, (ValueError, sparcoll.SparcollError)), error
            assert "block indices number (2147483648)" in str(error) and seconds < PROMPT, (error, seconds)
        assert comms[0].too_many_blocks(torch.zeros(10)) is None
        # 2^36 elements, yet 2^30 rows of 64: a block each, as many as the indices number
        assert comms[0].too_many_blocks(torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long),
                                                                torch.zeros(0, 64), (1 << 30, 64),
                                                                check_invariants=True)) is None
    finally:
        close(comms)


@pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), "soon", True])
def test_a_bad_per_call_timeout_is_a_value_error_and_the_peer_hears_of_it(store, timeout):
    comms = pair(store, f"timeout/{timeout}/")
    try:
        out = on_both(comms, lambda r, c: c.allreduce(
            torch.ones(100), timeout=timeout if r == 1 else None))
        assert isinstance(out[1][0], ValueError) and "timeout" in str(out[1][0])
        assert isinstance(out[0][0], sparcoll.SparcollError) and out[0][1] < PROMPT
        # the refusal says what it costs: the communicator takes no more collectives
        assert "create a new one with sparcoll.init()" in " ".join(getattr(out[1][0], "__notes__", []))
        with pytest.raises(sparcoll.PoisonedError):
            comms[1].allreduce(torch.ones(100))
    finally:
        close(comms)


@pytest.mark.parametrize("block_size", [4097, 65536])
def test_large_blocks_get_a_fitting_message_size(store, block_size):
    comms = pair(store, f"blocks/{block_size}/", block_size=block_size)
    try:
        assert comms[0].config.message_blocks * block_size * 8 <= 64 << 20
        inputs = {r: torch.randn(3 * block_size + 5, dtype=torch.float64) for r in range(2)}
        expected = inputs[0] + inputs[1]
        on_both(comms, lambda r, c: c.allreduce(inputs[r]))
        assert torch.allclose(inputs[0], expected) and torch.equal(inputs[0], inputs[1])
    finally:
        close(comms)
    with pytest.raises(ValueError, match="at most 1024 blocks per message fit"):
        Communicator(dist.HashStore(), 0, 2, block_size=8192, message_blocks=2048)


def test_a_communicator_recreated_on_the_same_prefix_does_not_read_stale_keys(store):
    for attempt in range(3):
        comms = pair(store, "same/")
        try:
            inputs = {r: torch.full((500,), float(attempt + r)) for r in range(2)}
            on_both(comms, lambda r, c: c.allreduce(inputs[r]))
            assert torch.equal(inputs[0], torch.full((500,), float(2 * attempt + 1)))
        finally:
            close(comms)


def test_coo_tensors_of_no_elements_come_back_empty_and_the_communicator_goes_on(store):
    """No rows, or rows of no elements (shape (10, 0)): nothing to sum, an empty result (the latter
    crashed in the scan-free path's block size, the former in the gathered path's reshape, poisoning
    the communicator); a peer whose call has elements is told of the mismatch, not left waiting."""
    comms = pair(store, "empty-coo/")
    try:
        for shape in ((0,), (0, 4), (10, 0)):
            def empty(rank, comm, shape=shape):
                indices = torch.tensor([[1, 2]]) if shape == (10, 0) else torch.zeros((1, 0), dtype=torch.long)
                values = torch.zeros((indices.shape[1], *shape[1:]))
                return comm.allreduce_coo(torch.sparse_coo_tensor(indices, values, shape, check_invariants=True))
            out = on_both(comms, empty)
            for r in range(2):
                result, seconds = out[r]
                assert isinstance(result, torch.Tensor), (shape, result)
                assert result.is_sparse and result.shape == shape and result._nnz() == 0 and seconds < PROMPT
        ones = {r: torch.ones(1000) for r in range(2)}
        on_both(comms, lambda r, c: c.allreduce(ones[r]))
        assert all(torch.equal(ones[r], torch.full((1000,), 2.0)) for r in range(2))
        mixed = {0: torch.sparse_coo_tensor(torch.tensor([[1, 2]]), torch.zeros(2, 0), (10, 0), check_invariants=True),
                 1: torch.sparse_coo_tensor(torch.tensor([[1, 2]]), torch.ones(2, 2), (10, 2), check_invariants=True)}
        out = on_both(comms, lambda r, c: c.allreduce_coo(mixed[r]))
        for r in range(2):
            error, seconds = out[r]
            assert isinstance(error, sparcoll.MismatchError) and seconds < PROMPT, (r, error, seconds)
    finally:
        close(comms)


@pytest.mark.parametrize("algorithm", ["sparse", "auto"])
def test_a_dense_tensor_and_a_coo_tensor_of_one_shape_are_a_mismatch_not_a_sum(store, algorithm):
    """Rank 0 reduces a dense (8, 512) tensor, rank 1 a COO one of that shape: their blocks had one
    descriptor on the sparse path, so they were summed, and the COO rank's rows came back spliced from
    the dense rank's blocks (row 3 holding halves of rows 3 and 4). Now both ranks are told."""
    comms = pair(store, f"dense-coo-{algorithm}/", algorithm=algorithm)
    try:
        dense = torch.zeros(8, 512)
        dense.view(-1)[7 * 256:9 * 256] = 1.0            # blocks 7 and 8: row 3's second half, row 4's first
        coo = torch.sparse_coo_tensor(torch.tensor([[6]]), torch.ones(1, 512), (8, 512), check_invariants=True)
        out = on_both(comms, lambda r, c: c.allreduce(dense) if r == 0 else c.allreduce_coo(coo))
        for r in range(2):
            error, seconds = out[r]
            assert isinstance(error, sparcoll.MismatchError) and seconds < PROMPT, (r, error, seconds)
        assert "COO" in str(out[0][0]) + str(out[1][0]), (out[0][0], out[1][0])
    finally:
        close(comms)


def test_a_coo_tensor_and_a_dense_one_of_as_many_elements_are_timed_as_kinds_of_their_own(store):
    """The chooser learns a kind's density and path times; a small COO table, gathered as one buffer of
    its elements and a mark per row (65,000 here), and a dense tensor of as many elements had shared
    them, mixing two workloads' trials."""
    from sparcoll import wire
    comms = pair(store, "coo-kinds/", algorithm="auto")
    try:
        rows = torch.tensor([[3, 900]])
        for _ in range(2):
            out = on_both(comms, lambda r, c: c.allreduce_coo(
                torch.sparse_coo_tensor(rows, torch.ones(2, 64), (1000, 64), check_invariants=True)))
            assert all(torch.equal(out[r][0].to_dense()[[3, 900]], torch.full((2, 64), 2.0)) for r in range(2))
            dense = {r: torch.ones(65_000) for r in range(2)}
            on_both(comms, lambda r, c: c.allreduce(dense[r]))
            assert all(torch.equal(dense[r], torch.full((65_000,), 2.0)) for r in range(2))
        for comm in comms.values():
            kinds = set(comm._engine.chooser._kinds)
            assert (65_000, 0, wire.Op.SUM) in kinds and (65_000, 0, wire.COO_OP) in kinds, kinds
    finally:
        close(comms)


def test_a_bad_wait_timeout_or_async_op_is_refused(store):
    comms = pair(store, "wait/")
    try:
        x = {r: torch.ones(100) for r in range(2)}
        works = on_both(comms, lambda r, c: c.allreduce(x[r], async_op=True))
        for r in range(2):
            work, _ = works[r]
            for bad in (-1, float("nan"), float("inf"), "1", True):
                with pytest.raises(ValueError, match="wait's timeout must be a finite number of seconds"):
                    work.wait(timeout=bad)
            assert torch.equal(work.wait(timeout=TIMEOUT), torch.full((100,), 2.0))
        out = on_both(comms, lambda r, c: c.allreduce(torch.ones(10), async_op="yes" if r == 0 else True).wait())
        assert isinstance(out[0][0], TypeError) and "async_op must be True or False" in str(out[0][0])
        assert isinstance(out[1][0], sparcoll.SparcollError) and "rank 0" in str(out[1][0]), out[1]
        assert out[1][1] < PROMPT
    finally:
        close(comms)


def test_a_forked_child_can_neither_use_nor_close_its_parents_communicator(store):
    """A DataLoader worker (forked) inherits the communicator: its calls went out on the parent's
    sockets, and a child's alone poisoned both parents with an error blaming the other rank. Now the
    child is told, and its close() leaves the parent's connections alone."""
    comms = pair(store, "fork/")
    try:
        pid = os.fork()
        if pid == 0:        # the child: reports by its exit status only, never returns into pytest
            code = 3
            try:
                comms[0].allreduce(torch.ones(10), timeout=2.0)
            except sparcoll.SparcollError as exc:
                code = 0 if "is a fork of it" in str(exc) else 2
            finally:
                for comm in comms.values():
                    comm.close()
                os._exit(code)
        deadline, status = time.monotonic() + 30, None
        while status is None and time.monotonic() < deadline:
            done, raw = os.waitpid(pid, os.WNOHANG)
            status = os.waitstatus_to_exitcode(raw) if done else time.sleep(0.05)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert status == 0, status
        out = on_both(comms, lambda rank, comm: comm.allreduce(torch.full((1000,), rank + 1.0)).tolist())
        assert out[0][0] == out[1][0] == [3.0] * 1000, out
    finally:
        close(comms)
