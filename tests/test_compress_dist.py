"""sparcoll.compress on 3 processes over gloo (and sparcoll for blocktopk): every compressor's
distributed result equals the reference computed here from all ranks' inputs, on every rank; seeds
and PowerSGD's Q agree across ranks; empty payloads (one rank, then all) do not hang anyone."""
import time

import numpy as np
import pytest
import torch

import sparcoll
import sparcoll.compress as sc
from ranks import run_ranks

WORLD = 3
STEPS = 3
SPECS = ["none", "fp16", "bf16", "topk:0.05", "randomk:0.1", "threshold:1.0", "dgc:0.05", "qsgd:8",
         "terngrad", "signsgd", "efsignsgd", "onebit", "powersgd:2", "blocktopk:0.5"]
COO_SPECS = ["none", "fp16", "topk:0.05", "threshold:0.5", "blocktopk:0.3"]


def grad(spec, rank, step):
    x = torch.randn(24, 40, generator=torch.Generator().manual_seed(1000 * step + rank))
    if spec.startswith("threshold"):
        return x * (rank != 1)      # rank 1 never has anything above the threshold: empty payloads
    return x


def embedding_grad(rank):
    emb = torch.nn.Embedding(300, 8, sparse=True)
    torch.nn.init.normal_(emb.weight, generator=torch.Generator().manual_seed(rank))
    emb(torch.randint(300, (20,), generator=torch.Generator().manual_seed(rank))).pow(2).sum().backward()
    return emb.weight.grad


def wire_input(rank):
    """8 non-zero blocks of 256 out of 64 per rank, of growing norm: blocktopk:0.0625 keeps the last 4."""
    big = torch.zeros(64, 256)
    big[rank:rank + 8] = (rank + 1.0) * torch.arange(1.0, 9.0).unsqueeze(1)
    return big.reshape(-1)


def to_numpy(value):
    """Tensors as numpy arrays: torch sends tensors between processes through shared memory that
    is gone once the child exits."""
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if isinstance(value, (list, tuple)):
        return type(value)(to_numpy(v) for v in value)
    return value


def to_torch(value):
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, (list, tuple)):
        return type(value)(to_torch(v) for v in value)
    return value


def everything(rank: int, world: int) -> dict:
    comm = sparcoll.init()
    try:
        out = {}
        for spec in SPECS:
            reducer = sc.Reducer(spec, comm=comm)
            out[spec] = [reducer.reduce(grad(spec, rank, step), key="w") for step in range(STEPS)]
            if spec.startswith("powersgd"):
                out["q"] = reducer.compressor.q["w"]
            several = [grad(spec, rank, 0), grad(spec, rank, 1)[:5], wire_input(rank)]
            keys = ["x", "y", "z"]
            out["many " + spec] = sc.Reducer(spec, comm=comm).reduce_many(several, keys)
            into = [torch.full((t.numel(),), float("nan")) for t in several]
            got = sc.Reducer(spec, comm=comm).reduce_many(several, keys, into=into)
            out["into " + spec] = (got, all(g is i for g, i in zip(got, into)))
            alone = sc.Reducer(spec, comm=comm)
            out["alone " + spec] = [alone.reduce(t, key=k) for t, k in zip(several, keys)]
        for spec in COO_SPECS:
            before = comm.stats.blocks_sent
            result = sc.Reducer(spec, comm=comm).reduce(embedding_grad(rank), key="e")
            out["coo " + spec] = (result.is_sparse, result.to_dense(), comm.stats.blocks_sent > before)
        thin = [grad("powersgd", rank, 0)[:, :1], grad("powersgd", rank, 0)[:2, :2]]
        out["thin"] = [sc.Reducer("powersgd:2", comm=comm).reduce(t, key="t") for t in thin]
        nothing = sc.Reducer("threshold:100", comm=comm)       # no rank has anything to send
        out["all empty"] = [nothing.reduce(grad("none", rank, step), key="w") for step in range(2)]
        big = wire_input(rank)
        before = comm.stats.blocks_sent
        out["wire"] = (sc.Reducer("blocktopk:0.0625", comm=comm).reduce(big, key="b"),
                       comm.stats.blocks_sent - before)
        return {key: to_numpy(value) for key, value in out.items()}
    finally:
        comm.close()


def reference(spec):
    """Each rank's compressor run alone (its own memory and seeds), then averaged; signsgd's
    majority vote from the ranks' payloads; PowerSGD on the ranks' mean (it is linear in M for a
    fixed Q, so the distributed P and Q are those of the mean), with each rank's residual."""
    locals_ = [sc.Reducer(spec) for _ in range(WORLD)]
    for rank, reducer in enumerate(locals_):
        reducer.compressor.seed_rank(rank)
    results = []
    if spec == "signsgd":       # no state: each step the majority vote of the ranks' payloads
        c = locals_[0].compressor
        return [c.combine([c.compress(grad(spec, r, step)).parts for r in range(WORLD)], 960).view(24, 40)
                for step in range(STEPS)]
    if spec.startswith("powersgd"):
        mean_reducer, residuals = sc.Reducer(spec + ",ef=off"), [0.0] * WORLD
        for step in range(STEPS):
            comps = [grad(spec, r, step) + residuals[r] for r in range(WORLD)]
            result = mean_reducer.reduce(sum(comps) / WORLD, key="w")
            residuals = [c - result for c in comps]
            results.append(result)
        return results
    for step in range(STEPS):
        results.append(sum(reducer.reduce(grad(spec, r, step), key="w")
                           for r, reducer in enumerate(locals_)) / WORLD)
    return results


@pytest.fixture(scope="module")
def outcome():
    """Sparcoll's sparse AllReduce pinned (its default, auto, may send small tensors by gloo's
    ring, which these tests are not about)."""
    return [{key: to_torch(value) for key, value in out.items()}
            for out in run_ranks(everything, WORLD, timeout=90, env={"SPARCOLL_ALGORITHM": "sparse"})]


@pytest.mark.parametrize("spec", SPECS)
def test_every_rank_gets_the_reference_average(outcome, spec):
    expected = reference(spec)
    assert len(expected) == STEPS
    tolerance = {"fp16": 2e-3, "bf16": 1e-2}.get(spec, 1e-5)   # ranks' shares summed in fp16/bf16
    for rank_out in outcome:
        got = rank_out[spec]
        for step, want in enumerate(expected):
            assert torch.equal(got[step], outcome[0][spec][step]), f"rank results differ at {step}"
            assert torch.allclose(got[step], want, atol=tolerance, rtol=tolerance), (spec, step)


@pytest.mark.parametrize("spec", SPECS)
def test_several_tensors_in_one_collective_equal_one_by_one(outcome, spec):
    for out in outcome:
        for many, alone, first in zip(out["many " + spec], out["alone " + spec],
                                      outcome[0]["many " + spec]):
            assert torch.equal(many, first)
            tolerance = {"fp16": 2e-3, "bf16": 1e-2}.get(spec, 1e-5)   # sums in another order
            assert torch.allclose(many, alone, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("spec", SPECS)
def test_averages_written_into_the_callers_tensors_are_those_returned_new(outcome, spec):
    """`into` (DataParallel's gradients): each scheme decompresses there, whatever they held."""
    for out in outcome:
        got, returned_into = out["into " + spec]
        assert returned_into
        for into, many in zip(got, out["many " + spec]):
            assert torch.equal(into, many.reshape(-1))


def test_powersgd_averages_a_tensor_it_cannot_shrink_exactly(outcome):
    """(24, 1) and (2, 2): rank-2 factors would hold more floats than the tensor."""
    expected = [sum(grad("powersgd", r, 0)[:, :1] for r in range(WORLD)) / WORLD,
                sum(grad("powersgd", r, 0)[:2, :2] for r in range(WORLD)) / WORLD]
    for out in outcome:
        for got, want in zip(out["thin"], expected):
            assert torch.allclose(got, want, atol=1e-6)


def test_powersgd_q_is_identical_on_every_rank(outcome):
    assert all(torch.equal(out["q"], outcome[0]["q"]) for out in outcome)


def test_empty_threshold_payloads_do_not_hang_and_give_zero(outcome):
    for out in outcome:
        assert not any(result.any() for result in out["all empty"])


@pytest.mark.parametrize("spec", COO_SPECS)
def test_sparse_coo_gradients(outcome, spec):
    locals_ = [sc.Reducer(spec) for _ in range(WORLD)]
    expected = sum(r.reduce(embedding_grad(i), key="e").to_dense()
                   for i, r in enumerate(locals_)) / WORLD
    for out in outcome:
        is_sparse, dense, through_sparcoll = out["coo " + spec]
        assert is_sparse
        assert through_sparcoll == (spec in ("none", "fp16", "blocktopk:0.3"))   # others: allgather
        assert torch.allclose(dense, expected, atol=2e-3 if spec == "fp16" else 1e-6)


def test_blocktopk_goes_through_the_sparse_allreduce(outcome):
    expected = torch.zeros(64 * 256)
    for rank in range(WORLD):
        contribution = wire_input(rank)
        contribution[:(rank + 4) * 256] = 0.0
        expected += contribution
    for out in outcome:
        result, blocks_sent = out["wire"]
        assert torch.equal(result, expected / WORLD)
        assert blocks_sent <= 4             # only its kept blocks, those of other ranks' shards
    assert sum(out["wire"][1] for out in outcome) > 0


DIFFERING = [("randomk:0.1,seed=1", "randomk:0.1,seed=2"), ("qsgd:127", "qsgd:128"), ("signsgd", "efsignsgd"),
             ("none", "topk:0.1")]


def differing_settings(rank: int, world: int) -> list:
    """Each pair's first spec on rank 0, its second on rank 1: what each rank's reduce raised."""
    raised = []
    for pair in DIFFERING:
        reducer = sc.Reducer(pair[rank])
        for _ in range(2):      # a caller that caught the first error calls again
            try:
                reducer.reduce(grad("none", rank, 0), key="w")
                raised.append(None)
            except sparcoll.MismatchError as exc:
                raised.append(str(exc))
    return raised


def test_ranks_that_compress_with_different_settings_get_a_mismatch_error():
    """A randomk seed that differed gave each rank its own average, silently (the models drift
    apart); qsgd's levels that differed killed both processes inside gloo (int8 against int16).
    A second call raises it again: it ran with the differing settings (a review's randomk gave the
    ranks different averages)."""
    for raised in run_ranks(differing_settings, 2, timeout=60):
        for (mine, theirs), message in zip([pair for pair in DIFFERING for _ in range(2)], raised):
            assert message is not None and "different settings" in message, (mine, message)
            assert str(sc.parse(mine)) in message and str(sc.parse(theirs)) in message


def differing_sizes(rank: int, world: int) -> list:
    """Every scheme, rank 0 reducing 100 elements where rank 1 reduces 200 (then the same counts and
    totals in another order, then agreeing sizes, which go through): what each call raised, and the
    agreeing call's average."""
    outcomes = []
    for spec in ("topk:0.5", "qsgd:127", "signsgd", "fp16", "randomk:0.5", "powersgd:2"):
        reducer = sc.Reducer(spec, timeout=30)
        for sizes in ([100] if rank == 0 else [200], [10, 20] if rank == 0 else [20, 10]):
            tensors = [torch.ones(n) for n in sizes]
            try:
                reducer.reduce_many(tensors, [f"w{i}" for i in range(len(tensors))])
                outcomes.append(None)
            except sparcoll.MismatchError as exc:
                outcomes.append(str(exc))
        outcomes.append(reducer.reduce(torch.full((64,), float(rank + 1)), key="same").mean().item())
    reducer, started = sc.Reducer("topk:0.5", timeout=30), time.monotonic()
    try:                    # rank 1 alone refuses its input: rank 0 waited for it until its timeout
        reducer.reduce(torch.ones(8, dtype=torch.int64 if rank == 1 else torch.float32), key="w")
    except (sparcoll.MismatchError, TypeError) as exc:
        outcomes.append((type(exc).__name__, str(exc), time.monotonic() - started))
    return outcomes


def test_ranks_that_reduce_tensors_of_different_sizes_get_a_mismatch_error():
    """A Reducer's allreduce of other sizes ended rank 0's process inside gloo, and a gather read
    rank 0's 100 values as the start of 200 on rank 1, without a word (a review)."""
    for rank, outcomes in enumerate(run_ranks(differing_sizes, 2, timeout=120)):
        kind, text, seconds = outcomes.pop()
        assert (kind, text) == (("MismatchError", "rank 1 refused its input to this call (a tensor not "
                                 "floating-point, or a key of another size)") if rank == 0 else
                                ("TypeError", "a Reducer averages floating-point tensors, got torch.int64"))
        assert seconds < 10, seconds
        for first, second, average in zip(outcomes[0::3], outcomes[1::3], outcomes[2::3]):
            assert "ranks reduce tensors of different sizes in one call: rank 0 1 of 100 elements, rank 1 1 of " \
                   "200 elements" == first, first
            assert second is not None and second.endswith("(the same counts and totals: other sizes or order)")
            assert 0 < average < 3     # the reducer goes on: of (1 + 2) / 2, what each compressor keeps
