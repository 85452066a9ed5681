"""The sans-IO protocol driven in memory: random workers, ranges, sparsity and delivery orders."""
import functools
import random
from collections import deque

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st, HealthCheck

from sparcoll import wire
from sparcoll.errors import MismatchError, ProtocolError
from sparcoll.protocol import AggregatorStream, Geometry, WorkerStream
from support import block_sparse


GARBAGE = 12345.0


def run_allreduce(inputs, nonzero, num_aggs, streams, message_blocks, credits, seed,
                  average=False, dtype=torch.float32, acc=torch.float32, worker_blocks=None,
                  reuse=None):
    """Run one collective through the state machines; return (outputs, pending peak, sent indices).
    `worker_blocks`: each worker's own message size (at most message_blocks), as workers that
    adapt their messages to the links they measure may differ. `reuse`: per worker, whether the
    aggregator may sum into its messages' memory. A buffer is overwritten with garbage the moment
    its lease is given back (as a reused receive buffer would be), a result's lease once every
    worker has taken that result, so a buffer given back while still read shows up as a wrong sum.
    (The protocol only passes leases through: any object serves as one here.)"""
    workers = len(inputs)
    worker_blocks = worker_blocks or [message_blocks] * workers
    reuse = reuse or [0] * workers
    buffers, released, result_readers = {}, [], {}

    def release(lease):
        released.append(lease)
        buffers[lease].fill_(GARBAGE)
    nblocks, block_size = inputs[0].shape
    geometry = Geometry(nblocks, num_aggs, streams)
    descriptor = (nblocks * block_size, block_size, 0, int(average))
    outputs = [torch.zeros_like(x) for x in inputs]
    rnd = random.Random(seed)
    wstreams, astreams, channels = {}, {}, {}
    for agg, stream, lo, hi in geometry.ranges():
        astreams[agg, stream] = AggregatorStream(lo, hi, workers, descriptor, dtype, acc, average,
                                                 message_blocks, credits)
        for w in range(workers):
            mine = nonzero[w][(nonzero[w] >= lo) & (nonzero[w] < hi)]
            wstreams[w, agg, stream] = WorkerStream(lo, hi, mine, worker_blocks[w], credits)
    # One FIFO per direction per (worker, aggregator) pair, as TCP gives; interleaving is random.
    for w in range(workers):
        for agg in range(num_aggs):
            channels["up", w, agg] = deque()
            channels["down", w, agg] = deque()

    def post_sends(w, agg, stream):
        ws = wstreams[w, agg, stream]
        for s in ws.next_sends():
            idx = ws.indices[s.start:s.stop]
            channels["up", w, agg].append((stream, s.seq, s.progress, idx,
                                           inputs[w][torch.from_numpy(idx)]))

    for (w, agg, stream) in wstreams:
        post_sends(w, agg, stream)
    sent = [set() for _ in range(workers)]
    peak = 0
    while any(channels.values()):
        key = rnd.choice([k for k, q in channels.items() if q])
        direction, w, agg = key
        msg = channels[key].popleft()
        if direction == "up":
            stream, seq, progress, idx, rows = msg
            sent[w].update(idx.tolist())
            a = astreams[agg, stream]
            lease = (w, agg, stream, seq)
            buffers[lease] = rows
            step = a.on_contribution(w, seq, progress, descriptor, idx, rows, lease,
                                     reuse=reuse[w])
            for lease in step.released:
                release(lease)
            peak = max(peak, a.pending_blocks)
            if step.result is not None:
                if step.result.lease is not None:
                    held = buffers[step.result.lease]     # the sums live in that buffer
                    offset = step.result.rows.data_ptr() - held.data_ptr()
                    assert 0 <= offset <= held.numel() * held.element_size() - \
                        step.result.rows.numel() * step.result.rows.element_size()
                    result_readers[id(step.result)] = workers
                for v in range(workers):
                    channels["down", v, agg].append((stream, step.result))
        else:
            stream, result = msg
            wstreams[w, agg, stream].on_result(result.seq, result.progress, result.indices)
            outputs[w][torch.from_numpy(result.indices)] = result.rows
            if result.lease is not None:
                result_readers[id(result)] -= 1
                if result_readers[id(result)] == 0:
                    release(result.lease)
            post_sends(w, agg, stream)
    assert all(ws.done for ws in wstreams.values())
    assert all(a.done and a.pending_blocks == 0 for a in astreams.values())
    assert sorted(released) == sorted(buffers), "every message's buffer released exactly once"
    return outputs, peak, sent


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workers=st.integers(1, 8), num_aggs=st.integers(1, 4), streams=st.integers(1, 3),
       nblocks=st.integers(0, 80), block_size=st.sampled_from([1, 3, 4, 16]),
       density=st.sampled_from([0.0, 0.05, 0.3, 0.7, 1.0]), message_blocks=st.integers(1, 9),
       credits=st.integers(1, 4), average=st.booleans(), uneven=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_result_is_dense_sum_in_any_delivery_order(workers, num_aggs, streams, nblocks, block_size,
                                                   density, message_blocks, credits, average,
                                                   uneven, seed):
    rng = torch.Generator().manual_seed(seed)
    inputs, nonzero = zip(*(block_sparse(rng, nblocks, block_size, density) for _ in range(workers)))
    # uneven: every worker cuts its messages at its own size (dense data then takes the
    # aggregator's gapless-runs path), else all the same size (its equal-indices path)
    worker_blocks = [random.Random(seed + w).randint(1, message_blocks) for w in range(workers)] \
        if uneven else None
    reuse = [random.Random(seed - w).randint(0, 2) for w in range(workers)]
    outputs, peak, sent = run_allreduce(list(inputs), list(nonzero), num_aggs, streams,
                                        message_blocks, credits, seed, average=average,
                                        worker_blocks=worker_blocks, reuse=reuse)
    reference = torch.stack(inputs).double().sum(0)
    if average:
        reference /= workers
    for out in outputs:
        assert torch.equal(out.double(), reference.float().double())
    for w in range(workers):   # only this worker's non-zero blocks ever left it
        assert sent[w] == set(nonzero[w].tolist())
    # Pending state is bounded by workers x credits x message_blocks per (aggregator, stream).
    assert peak <= workers * credits * message_blocks


def test_union_zero_blocks_are_never_in_results():
    rng = torch.Generator().manual_seed(1)
    inputs, nonzero = zip(*(block_sparse(rng, 200, 8, 0.05) for _ in range(3)))
    union = set().union(*(set(n.tolist()) for n in nonzero))
    results = []
    geometry = Geometry(200, 2, 2)
    desc = (1600, 8, 0, 0)
    for agg, stream, lo, hi in geometry.ranges():
        a = AggregatorStream(lo, hi, 3, desc, torch.float32, torch.float32, False, 4, 2)
        ws = [WorkerStream(lo, hi, n[(n >= lo) & (n < hi)], 4, 2) for n in nonzero]
        while not a.done:
            for w, s in enumerate(ws):
                for send in s.next_sends():
                    idx = s.indices[send.start:send.stop]
                    step = a.on_contribution(w, send.seq, send.progress, desc, idx,
                                             inputs[w][torch.from_numpy(idx)])
                    if step.result is not None:
                        results.append(step.result)
                        for v in ws:
                            v.on_result(step.result.seq, step.result.progress, step.result.indices)
    got = set()
    for r in results:
        got.update(r.indices.tolist())
    assert got == union


@pytest.mark.parametrize("code", [1, 2])         # float16, bfloat16
@pytest.mark.parametrize("contributions", ["same blocks", "cut at different points", "different blocks"])
def test_half_precision_sums_accumulate_in_the_wire_tables_dtype(code, contributions):
    """Each of the aggregator's three ways to sum (plain adds, slices of a gapless span, index_add)
    accumulates in wire.DTYPES's accumulation dtype. Integers up to the half type's exact range sum
    exactly in float32, while half-precision partial sums above it round: the result must be the
    exact sum rounded once. (Only the plain adds were covered, with the dtype handed in; summing a
    gapless span in float16 gave 2048 for 2048 + 1 + 1 + 1: a mutation review.)"""
    dtype, acc = wire.DTYPES[code]
    top = 2048 if dtype == torch.float16 else 256
    g = torch.Generator().manual_seed(code)
    workers, nblocks, block = 4, 6, 8
    inputs = [torch.randint(0, top + 1, (nblocks, block), generator=g).to(dtype) for _ in range(workers)]
    nonzero = [np.arange(nblocks)] * workers
    if contributions == "different blocks":
        nonzero = [np.arange(nblocks)] + [np.arange(w % 2, nblocks, 2) for w in range(1, workers)]
        for x, listed in zip(inputs, nonzero):
            x[np.setdiff1d(np.arange(nblocks), listed)] = 0
    worker_blocks = [1, 3, 2, 3] if contributions == "cut at different points" else None
    expected = torch.stack([x.double() for x in inputs]).sum(0).to(dtype)
    assert not torch.equal(expected, functools.reduce(torch.add, inputs))     # half sums would round
    for seed in range(3):
        outputs, _, _ = run_allreduce(inputs, nonzero, 1, 1, 3, 4, seed, dtype=dtype, acc=acc,
                                      worker_blocks=worker_blocks)
        for out in outputs:
            assert torch.equal(out, expected), (seed, (out.double() - expected.double()).abs().max())


def test_nan_and_inf_propagate_like_a_dense_sum():
    inputs = [torch.zeros(3, 2), torch.zeros(3, 2)]
    inputs[0][0, 0] = float("nan")
    inputs[1][1, 1] = float("inf")
    inputs[0][1, 0] = 1.0
    nonzero = [np.array([0, 1]), np.array([1])]
    outputs, _, _ = run_allreduce(inputs, nonzero, 1, 1, 4, 2, 0)
    torch.testing.assert_close(outputs[1], inputs[0] + inputs[1], equal_nan=True)


def make_stream(workers=2, credits=2, message_blocks=4):
    return AggregatorStream(0, 10, workers, (40, 4, 0, 0), torch.float32, torch.float32, False,
                            message_blocks, credits)


def test_aggregator_rejects_bad_messages():
    rows = torch.ones(2, 4)
    desc = (40, 4, 0, 0)
    with pytest.raises(MismatchError, match="numel 80 where another rank has numel 40"):
        make_stream().on_contribution(0, 0, 5, (80, 4, 0, 0), np.array([1, 2]), rows)
    with pytest.raises(ProtocolError, match="not strictly increasing"):
        make_stream().on_contribution(0, 0, 5, desc, np.array([2, 2]), rows)
    with pytest.raises(ProtocolError, match="outside"):
        make_stream().on_contribution(0, 0, 5, desc, np.array([3, 7]), rows)
    with pytest.raises(ProtocolError, match="seq 1, expected 0"):
        make_stream().on_contribution(0, 1, 5, desc, np.array([1, 2]), rows)
    with pytest.raises(ProtocolError, match="unknown worker"):
        make_stream().on_contribution(5, 0, 5, desc, np.array([1, 2]), rows)
    with pytest.raises(ProtocolError, match="blocks in a message"):
        make_stream(message_blocks=1).on_contribution(0, 0, 5, desc, np.array([1, 2]), rows)
    with pytest.raises(ProtocolError, match="data of shape"):
        make_stream().on_contribution(0, 0, 5, desc, np.array([1, 2]), torch.ones(2, 3))
    a = make_stream(credits=1)
    a.on_contribution(0, 0, 3, desc, np.array([1, 2]), rows)
    with pytest.raises(ProtocolError, match="credits"):
        a.on_contribution(0, 1, 5, desc, np.array([3, 4]), rows)
    a = make_stream()
    a.on_contribution(0, 0, 3, desc, np.array([1, 2]), rows)
    with pytest.raises(ProtocolError, match="outside"):   # re-sends a block below its own p
        a.on_contribution(0, 1, 5, desc, np.array([2, 4]), rows)


def test_a_stream_names_the_workers_its_next_result_waits_for():
    """What a stalled collective's timeout names: the workers at the lowest progress, and whether
    each has sent anything yet; none once the range is done."""
    desc, rows = (40, 4, 0, 0), torch.ones(1, 4)
    a = make_stream(workers=3)
    assert a.holding_back() == [0, 1, 2] and not any(map(a.heard_from, range(3)))
    a.on_contribution(0, 0, 10, desc, np.array([1]), rows)
    a.on_contribution(1, 0, 4, desc, np.array([1]), rows)
    assert a.holding_back() == [2] and a.heard_from(1) and not a.heard_from(2)
    a.on_contribution(2, 0, 4, desc, np.array([3]), rows)
    assert a.holding_back() == [1, 2] and a.heard_from(2)
    a.on_contribution(1, 1, 10, desc, np.array([5]), rows)
    a.on_contribution(2, 1, 10, desc, np.array([], dtype=np.int64), torch.ones(0, 4))
    assert a.done and a.holding_back() == []


def test_a_released_worker_s_contributions_are_copies_and_the_sum_is_theirs():
    """Worker 0 lends its rows in place (reuse 2) and gives up the collective: release returns their
    leases and the stream keeps copies, so worker 0 may overwrite its rows and the sum worker 1
    completes is still of the rows as sent, in memory that is not worker 0's."""
    desc = (40, 4, 0, 0)
    a = make_stream()
    mine, theirs = torch.ones(2, 4), torch.full((2, 4), 2.0)
    assert a.on_contribution(0, 0, 9, desc, np.array([1, 2]), mine, "lease 0", reuse=2).result is None
    assert a.release(0) == ["lease 0"]
    assert a.release(1) == []
    mine.fill_(5)                               # the rank owns its tensor again
    step = a.on_contribution(1, 0, 9, desc, np.array([1, 2]), theirs, "lease 1", reuse=1)
    assert step.result is not None and step.result.lease in (None, "lease 1")
    torch.testing.assert_close(step.result.rows, torch.full((2, 4), 3.0))
    assert torch.equal(mine, torch.full((2, 4), 5.0))


def test_a_dropped_stream_gives_back_every_contribution_it_holds():
    desc = (40, 4, 0, 0)
    a = make_stream()
    a.on_contribution(0, 0, 3, desc, np.array([1, 2]), torch.ones(2, 4), "a")
    step = a.on_contribution(1, 0, 9, desc, np.array([1, 2, 5]), torch.ones(3, 4), "b")
    assert step.result.progress == 3 and step.released == ["a"]   # block 5 of "b" waits for worker 0
    assert a.drop() == ["b"]
    assert a.drop() == []


def test_worker_rejects_results_that_break_the_rules():
    ws = WorkerStream(0, 10, np.array([1, 5]), 1, 1)   # one credit: sends [1], p=5
    ws.next_sends()
    with pytest.raises(ProtocolError, match="progress"):
        ws.on_result(0, 9, np.array([1]))          # beyond what this worker reported
    with pytest.raises(ProtocolError, match="omits"):
        ws.on_result(0, 5, np.array([2]))
    with pytest.raises(ProtocolError, match="seq"):
        ws.on_result(3, 5, np.array([1]))
    ws.on_result(0, 5, np.array([1, 3]))
    assert ws.next_sends()[0].start == 1



def test_a_collectives_first_message_costs_little_however_many_workers_the_job_declares():
    """An aggregator makes a collective's streams at its first message, which a client holding the
    secret may send with 0 blocks for a job of 4,096 workers: each stream kept two queues per worker
    from the start, 48.5 MiB for 8 streams (about 400 MB for 64), made in about 0.5 s (a review).
    Now a worker's queues are made at its first message; the sum is the same."""
    import tracemalloc

    descriptor = (1 << 24, 256, 0, 0, 0)
    tracemalloc.start()
    try:
        streams = [AggregatorStream(s * 1024, (s + 1) * 1024, 4096, descriptor, torch.float32, torch.float32,
                                    False, 2048, 64) for s in range(8)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, f"{peak / 2 ** 20:.1f} MiB for 8 streams of 4,096 workers"
    stream, rows = streams[0], torch.arange(4 * 256, dtype=torch.float32).view(4, 256)
    indices = np.arange(4, dtype=np.int64)
    for worker in range(4096):      # every worker's 4 blocks, and the end of its range
        step = stream.on_contribution(worker, 0, 1023, descriptor, indices, rows.clone())
    assert step.result is not None and step.result.progress == 1023
    assert np.array_equal(step.result.indices, indices)
    torch.testing.assert_close(step.result.rows, rows * 4096)
