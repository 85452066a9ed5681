"""The protocol over a lossy transport, simulated in memory: random loss, duplication and reordering of
every message in both directions, timeouts that trigger retransmission; the result must be exact and no
contribution may be counted twice."""
import random
from collections import Counter

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from sparcoll.lossy import LossyAggregatorStream, LossyWorkerStream
from sparcoll.protocol import Geometry
from support import block_sparse

MAX_EVENTS = 200_000


def run_lossy(inputs, nonzero, num_aggs, message_blocks, credits, loss, duplication, seed):
    workers = len(inputs)
    nblocks, block_size = inputs[0].shape
    descriptor = (nblocks * block_size, block_size, 0, 0)
    rnd = random.Random(seed)
    outputs = [torch.zeros_like(x) for x in inputs]
    aggs, wss = {}, {}
    for agg, _, lo, hi in Geometry(nblocks, num_aggs, 1).ranges():
        aggs[agg] = LossyAggregatorStream(lo, hi, workers, descriptor, torch.float32,
                                          torch.float32, False, message_blocks, credits)
        for w in range(workers):
            mine = nonzero[w][(nonzero[w] >= lo) & (nonzero[w] < hi)]
            wss[w, agg] = LossyWorkerStream(lo, hi, mine, message_blocks, credits)
    flight = []          # (destination kind, worker, aggregator, payload): any order, any loss
    counted = Counter()  # (worker, block) -> times the aggregator accumulated it
    written = Counter()  # (worker, block) -> times a result was applied at the worker

    def post(*message):
        if rnd.random() >= loss:
            flight.append(message)

    def contribute(w, agg, sends):
        ws = wss[w, agg]
        for s in sends:
            idx = ws.indices[s.start:s.stop]
            post("up", w, agg, (s.seq, s.progress, idx, inputs[w][torch.from_numpy(idx)],
                                ws.next_result))

    for (w, agg), ws in wss.items():
        contribute(w, agg, ws.next_sends())
    for _ in range(MAX_EVENTS):
        if all(ws.done for ws in wss.values()) and all(a.finished for a in aggs.values()):
            break
        if not flight:   # nothing moves: every party's timer fires
            for (w, agg), ws in wss.items():
                contribute(w, agg, ws.retransmit())
                post("ack", w, agg, ws.next_result)
            continue
        message = flight.pop(rnd.randrange(len(flight)))
        if rnd.random() < duplication:
            flight.append(message)
        kind, w, agg, payload = message
        a = aggs[agg]
        if kind in ("up", "ack"):
            if kind == "up":
                seq, progress, idx, rows, ack = payload
                step = a.on_contribution(w, seq, progress, descriptor, idx, rows, ack=ack)
                if step.accepted:
                    counted.update((w, int(b)) for b in idx)
            else:
                step = a.on_ack(w, payload)
            for r in step.resend:
                post("down", w, agg, r)
            if step.result is not None:
                for v in range(workers):
                    post("down", v, agg, step.result)
        else:
            ws = wss[w, agg]
            if ws.on_result(payload.seq, payload.progress, payload.indices):
                outputs[w][torch.from_numpy(payload.indices)] = payload.rows
                written.update((w, int(b)) for b in payload.indices)
                contribute(w, agg, ws.next_sends())
    else:
        raise AssertionError("the simulation did not converge")
    return outputs, counted, written


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workers=st.integers(1, 5), num_aggs=st.integers(1, 3), nblocks=st.integers(0, 60),
       density=st.sampled_from([0.0, 0.1, 0.5, 1.0]), message_blocks=st.integers(1, 6),
       credits=st.integers(1, 3), loss=st.sampled_from([0.0, 0.1, 0.3]),
       duplication=st.sampled_from([0.0, 0.1, 0.3]), seed=st.integers(0, 2**31 - 1))
def test_lossy_duplicating_reordering_transport_gives_the_exact_sum(
        workers, num_aggs, nblocks, density, message_blocks, credits, loss, duplication, seed):
    rng = torch.Generator().manual_seed(seed)
    inputs, nonzero = zip(*(block_sparse(rng, nblocks, 3, density) for _ in range(workers)))
    outputs, counted, written = run_lossy(list(inputs), list(nonzero), num_aggs, message_blocks,
                                          credits, loss, duplication, seed)
    reference = torch.stack(inputs).double().sum(0).float()
    for out in outputs:
        assert torch.equal(out, reference)
    # Every non-zero block of every worker was accumulated exactly once, whatever was re-sent.
    assert counted == Counter((w, int(b)) for w in range(workers) for b in nonzero[w])
    union = set().union(*(set(n.tolist()) for n in nonzero))
    assert written == Counter((w, b) for w in range(workers) for b in union)


def test_a_stale_ack_resends_only_what_its_worker_still_lacks():
    """A duplicate of an old message carries an old ack: the aggregator sends that worker again only
    the results after the newest ack it has from it (before: every kept result, at each duplicate)."""
    import numpy as np
    descriptor = (4 * 3, 3, 0, 0)
    agg = LossyAggregatorStream(0, 4, 2, descriptor, torch.float32, torch.float32, False, 1, 4)
    results = []
    for block in range(2):       # two rounds of one block from each worker: two results
        for w in range(2):
            step = agg.on_contribution(w, block, block + 1, descriptor, np.array([block], dtype=np.int32),
                                       torch.ones(1, 3), ack=0)
            results += [step.result] if step.result is not None else []
    assert [r.seq for r in results] == [0, 1]
    assert agg.on_ack(0, 2).resend == []           # worker 0 has both; worker 1 none: both are kept
    assert agg.on_ack(0, 0).resend == []           # a stale duplicate of worker 0's first message
    assert [r.seq for r in agg.on_ack(1, 0).resend] == [0, 1]
