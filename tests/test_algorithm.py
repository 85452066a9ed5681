"""The choice between the sparse AllReduce and gloo's ring (algorithm.py) and the guarded ring itself
(ring.py): sums against references computed another way, identical choices on every rank, and clear
errors instead of gloo's process abort when ranks disagree."""
from __future__ import annotations

import functools
import math
import time
import types
import warnings

import pytest
import torch

from sparcoll import Communicator, MismatchError, SparcollError, wire
from sparcoll.algorithm import (LOOK_EVERY, RETRY_EVERY, SAMPLE_BLOCKS, SMALL_TRIALS, TINY_NUMEL, TRIALS,
                                Algorithm, Chooser, candidate_block_sizes, entry_block_size)
from sparcoll.blocks import entries_share_blocks
from support import block_sparse, on_threads

pytestmark = pytest.mark.auto_algorithm
BIG = 256 * 1024        # too large to gather over 2 or more ranks (GATHER_ELEMENTS)
GATHERABLE = 64 * 1024  # small enough over up to 4
KIND = (BIG, 0, 0)
WORLD = 8       # the chooser's tests: KIND is too large to gather over any world (GATHER_ELEMENTS)


def with_density(numel: int, density: float, seed: int = 0) -> torch.Tensor:
    data, _ = block_sparse(torch.Generator().manual_seed(seed), numel // 256, 256, density)
    return data.view(-1)


# ---- the chooser alone ----------------------------------------------------------------------------

def test_tiny_goes_to_the_ring_and_a_kinds_first_collective_to_the_sparse_path():
    chooser = Chooser(Algorithm.AUTO, 256, WORLD)
    assert chooser.choose((TINY_NUMEL, 0, 0), coo=False) is Algorithm.RING
    assert chooser.choose((TINY_NUMEL + 1, 0, 0), coo=False) is Algorithm.SPARSE
    assert chooser.choose((8, 0, 0), coo=True) is Algorithm.SPARSE


def run_dense_kind(chooser: Chooser, sparse_s: float, ring_s: float, gather_s: float = 1.0,
                   calls: int = 6, numel: int = BIG, density: float = 1.0) -> list[Algorithm]:
    """`calls` collectives of a kind of `numel` elements (dense unless `density` says otherwise),
    on one rank whose peers measure the same; which path each took. A round on gloo shares the
    times when asked, as ring.py does (the averages of one rank's values are its values)."""
    taken, kind = [], (numel, 0, 0)
    seconds = {Algorithm.SPARSE: sparse_s, Algorithm.RING: ring_s, Algorithm.GATHER: gather_s}
    for _ in range(calls):
        algorithm = chooser.choose(kind, coo=False)
        share = chooser.to_share(kind)
        if algorithm.on_gloo and share is not None:
            chooser.shared(kind, share)
        chooser.learn(kind, with_density(numel, density), algorithm, seconds[algorithm])
        taken.append(algorithm)
    return taken


def test_a_dense_kind_is_timed_on_both_paths_then_keeps_the_faster():
    S, R = Algorithm.SPARSE, Algorithm.RING
    trials = [S] * TRIALS + [R] * (TRIALS + 1)      # the last ring call shares the times
    calls = len(trials) + 1
    assert run_dense_kind(Chooser(Algorithm.AUTO, 256, WORLD), 0.06, 0.05, calls=calls) == trials + [R]
    assert run_dense_kind(Chooser(Algorithm.AUTO, 256, WORLD), 0.6, 0.8, calls=calls) == trials + [S]
    # within the margin the ring keeps it: dense data costs the sparse path CPU
    assert run_dense_kind(Chooser(Algorithm.AUTO, 256, WORLD), 0.57, 0.6, calls=calls) == trials + [R]
    assert Chooser(Algorithm.AUTO, 256, WORLD).choose((BIG, 0, 1), coo=False) is S  # another op


def test_a_choice_lasts_retry_every_collectives_then_the_kind_is_timed_anew():
    """Trials that misled (the sparse path looked faster) keep the kind for RETRY_EVERY collectives,
    counting the one that shared the times; the last of them starts the trials again (its own time
    the sparse path's first), and the ring, now measured faster, keeps the kind. Times are not
    kept between trials."""
    S, R = Algorithm.SPARSE, Algorithm.RING
    chooser = Chooser(Algorithm.AUTO, 256, WORLD)
    trials = [S] * TRIALS + [R] * (TRIALS + 1)
    assert run_dense_kind(chooser, sparse_s=0.04, ring_s=0.08, calls=len(trials)) == trials
    settled = run_dense_kind(chooser, sparse_s=0.08, ring_s=0.05, calls=RETRY_EVERY - 1)
    assert settled == [S] * (RETRY_EVERY - 1)
    assert chooser._kinds[KIND].times == {S: [0.08]}
    again = run_dense_kind(chooser, sparse_s=0.08, ring_s=0.05, calls=TRIALS - 1 + TRIALS + 1 + 2)
    assert again == [S] * (TRIALS - 1) + [R] * (TRIALS + 1) + [R, R]


def test_a_kind_small_enough_is_also_timed_gathered_and_the_fastest_keeps_it():
    """Over 2 ranks GATHERABLE fits GATHER_ELEMENTS: each path is timed SMALL_TRIALS times, gather
    last, and it shares the times; over 8 ranks it does not fit."""
    S, R, G = Algorithm.SPARSE, Algorithm.RING, Algorithm.GATHER
    trials = [S] * SMALL_TRIALS + [R] * SMALL_TRIALS + [G] * (SMALL_TRIALS + 1)
    calls, n = len(trials) + 2, GATHERABLE
    assert run_dense_kind(Chooser(Algorithm.AUTO, 256, 2), 0.06, 0.05, 0.04, calls, n) == \
        trials + [G, G]
    assert run_dense_kind(Chooser(Algorithm.AUTO, 256, 2), 0.06, 0.04, 0.05, calls, n) == \
        trials + [R, R]
    assert run_dense_kind(Chooser(Algorithm.AUTO, 256, 2), 0.03, 0.05, 0.04, calls, n) == \
        trials + [S, S]
    # within the margin of the faster gloo path, that one keeps it
    assert run_dense_kind(Chooser(Algorithm.AUTO, 256, 2), 0.038, 0.05, 0.04, calls, n) == \
        trials + [G, G]
    assert G not in run_dense_kind(Chooser(Algorithm.AUTO, 256, 8), 0.06, 0.05, 0.01, calls, n)
    assert Chooser(Algorithm.RING, 256, 2).choose(KIND, coo=False) is R     # never forced


@pytest.mark.parametrize("density", [0.0, 0.05, 0.3])
def test_a_kind_small_enough_to_gather_is_timed_at_any_density(density):
    """The sparse path's fixed cost (a message to every aggregator and back) may exceed what zero
    blocks save on a small kind: it is timed on every path at any density, and the fastest keeps
    it, whatever the density of later results. A larger kind's sparse results keep it on the
    sparse path untimed, and a forced mode keeps no times."""
    S, R, G = Algorithm.SPARSE, Algorithm.RING, Algorithm.GATHER
    trials = [S] * SMALL_TRIALS + [R] * SMALL_TRIALS + [G] * (SMALL_TRIALS + 1)
    calls, n = len(trials) + 2, GATHERABLE
    run = functools.partial(run_dense_kind, calls=calls, numel=n, density=density)
    chooser = Chooser(Algorithm.AUTO, 256, 2)
    assert run(chooser, 0.06, 0.05, 0.01) == trials + [G, G]
    # results on either side of CANDIDATE_DENSITY do not start the trials over
    for other in (1.0, density, 1.0):       # each long enough to be looked at (LOOK_EVERY)
        taken = run(chooser, 0.06, 0.05, 0.01, density=other, calls=LOOK_EVERY + 1)
        assert taken == [G] * (LOOK_EVERY + 1)
    assert run(Chooser(Algorithm.AUTO, 256, 2), 0.01, 0.05, 0.04) == trials + [S, S]
    large = Chooser(Algorithm.AUTO, 256, WORLD)
    assert run_dense_kind(large, 0.06, 0.01, calls=calls, density=density) == [S] * calls
    assert large._kinds[KIND].times == {}
    forced = Chooser(Algorithm.SPARSE, 256, 2)
    assert run(forced, 0.06, 0.05, 0.01) == [S] * calls
    assert forced._kinds[(n, 0, 0)].times == {}


def test_a_densified_coo_kind_is_timed_like_a_small_dense_kind_and_a_tiny_one_not_at_all():
    """A small COO tensor's buffer kind (densified.py) densifies only with "auto" and while small
    enough to gather; its trials' times come from learn_time, with no result to look at; a tiny
    one always takes the ring in one round and keeps no times."""
    S, R, G = Algorithm.SPARSE, Algorithm.RING, Algorithm.GATHER
    kind, big = (GATHERABLE + 256, 0, 0), (BIG, 0, 0)
    chooser = Chooser(Algorithm.AUTO, 256, 2)
    assert chooser.timed_at_any_density(kind) and not chooser.timed_at_any_density(big)
    assert not Chooser(Algorithm.SPARSE, 256, 2).timed_at_any_density(kind)
    assert not Chooser(Algorithm.RING, 256, 2).timed_at_any_density(kind)
    seconds, taken = {S: 0.006, R: 0.004, G: 0.005}, []
    for _ in range(3 * SMALL_TRIALS + 2):
        path = chooser.choose(kind, coo=False)
        share = chooser.to_share(kind)
        if path.on_gloo and share is not None:
            chooser.shared(kind, share)
        chooser.learn_time(kind, path, seconds[path])
        taken.append(path)
    assert taken == [S] * SMALL_TRIALS + [R] * SMALL_TRIALS + [G] * (SMALL_TRIALS + 1) + [R]
    tiny = (TINY_NUMEL, 0, 0)
    assert chooser.choose(tiny, coo=False) is R
    chooser.learn_time(tiny, R, 0.001)
    assert tiny not in chooser._kinds


def test_a_small_kind_compares_its_trials_medians_a_larger_one_their_best():
    """One short collective may fall in a lucky moment whole (a link's idle burst): a small kind
    compares the median of each path's trials, and one lucky ring call among slow ones does not
    win it; a larger kind compares the best, which discounts its slower first collectives."""
    S, R, G = Algorithm.SPARSE, Algorithm.RING, Algorithm.GATHER
    for world, numel, kept in ((2, GATHERABLE, S), (WORLD, BIG, R)):
        chooser, kind = Chooser(Algorithm.AUTO, 256, world), (numel, 0, 0)
        paths, trials = chooser.paths(kind)
        times = {S: [0.005] * trials, R: [0.003] + [0.009] * (trials - 1), G: [0.012] * trials}
        for path in paths:
            for seconds in times[path]:
                assert chooser.choose(kind, coo=False) is path
                chooser.learn(kind, with_density(numel, 1.0), path, seconds)
        chooser.shared(kind, chooser.to_share(kind))
        assert chooser.choose(kind, coo=False) is kept, world


def test_a_sparse_result_sends_a_kind_back_to_the_sparse_path_and_a_dense_one_tries_again():
    """Settled on the ring, a kind's density is looked at every LOOK_EVERY collectives, counting
    the one that settled it: the LOOK_EVERY-th sends it back when sparse, not one before."""
    chooser = Chooser(Algorithm.AUTO, 256, WORLD)
    run_dense_kind(chooser, sparse_s=0.06, ring_s=0.05, calls=2 * TRIALS + 1)    # settles in the last
    assert chooser.choose(KIND, coo=False) is Algorithm.RING
    sparse_result = with_density(BIG, 0.05)
    for _ in range(LOOK_EVERY - 2):
        chooser.learn(KIND, sparse_result, Algorithm.RING, 0.05)
        assert chooser.choose(KIND, coo=False) is Algorithm.RING
    chooser.learn(KIND, sparse_result, Algorithm.RING, 0.05)
    assert chooser.choose(KIND, coo=False) is Algorithm.SPARSE
    # Dense again: the kind was clearly sparse, so the LOOK_EVERY-th result is the first looked at;
    # from it the kind is timed anew (the old times were of other data), the sparse path first.
    taken = run_dense_kind(chooser, sparse_s=0.05, ring_s=0.07, calls=LOOK_EVERY + 2 * TRIALS)
    assert taken[:LOOK_EVERY] == [Algorithm.SPARSE] * LOOK_EVERY
    assert taken[LOOK_EVERY:] == [Algorithm.SPARSE] * (TRIALS - 1) + [Algorithm.RING] * (TRIALS + 1)
    assert chooser.choose(KIND, coo=False) is Algorithm.SPARSE


def test_a_clearly_sparse_kind_is_looked_at_every_look_every_collectives_a_less_sparse_one_each_time():
    """Below CLEARLY_SPARSE a kind's results are looked at every LOOK_EVERY collectives (counting
    the one looked at), so a dense one is noticed at the LOOK_EVERY-th; between it and
    CANDIDATE_DENSITY at every collective."""
    for share, waits in ((0.05, LOOK_EVERY - 1), (0.3, 0)):
        chooser = Chooser(Algorithm.AUTO, 256, WORLD)
        chooser.learn(KIND, with_density(BIG, share), Algorithm.SPARSE, 0.01)
        dense = with_density(BIG, 1.0)
        for _ in range(waits):
            assert chooser.choose(KIND, coo=False) is Algorithm.SPARSE
            chooser.learn(KIND, dense, Algorithm.SPARSE, 0.01)
            assert not chooser._kinds[KIND].dense, share        # not looked at
        chooser.learn(KIND, dense, Algorithm.SPARSE, 0.01)
        assert chooser._kinds[KIND].dense, share                # looked at


def test_forced_modes():
    assert Chooser(Algorithm.SPARSE, 256, WORLD).choose((8, 0, 0), coo=False) is Algorithm.SPARSE
    assert run_dense_kind(Chooser(Algorithm.SPARSE, 256, WORLD), 0.6, 0.1) == [Algorithm.SPARSE] * 6
    assert Chooser(Algorithm.RING, 256, WORLD).choose(KIND, coo=False) is Algorithm.RING
    assert Chooser(Algorithm.RING, 256, WORLD).choose(KIND, coo=True) is Algorithm.SPARSE


@pytest.mark.parametrize("density", [0.0, 0.02, 0.5, 0.9, 1.0])
def test_density_estimate_is_close_and_the_same_for_equal_results(density):
    numel = 4096 * 256          # more blocks than are sampled
    tensor = with_density(numel, density, seed=3)
    exact = tensor.view(-1, 256).ne(0).any(1).float().mean().item()
    a = Chooser(Algorithm.AUTO, 256, WORLD).densities(KIND, tensor)[256]
    b = Chooser(Algorithm.AUTO, 256, WORLD).densities(KIND, tensor.clone())[256]
    assert a == b
    # SAMPLE_BLOCKS draws without replacement: 4 standard deviations at most.
    assert abs(a - exact) <= 4 * (0.25 / SAMPLE_BLOCKS) ** 0.5


@pytest.mark.parametrize("blocks", [100, 4096])
def test_density_at_every_block_size_is_the_share_of_non_zero_sub_blocks_looked_at(blocks):
    """Against the sub-blocks counted directly, in every block looked at (all of a small result,
    the sample of a large one): -0.0 counts as zero, NaN and Inf as non-zero, as in the scan."""
    g = torch.Generator().manual_seed(5)
    tensor = torch.zeros(blocks * 256)
    picked = torch.randperm(tensor.numel(), generator=g)[:blocks * 3]
    values = torch.tensor([1.0, -0.0, float("nan"), float("inf"), -2.5])
    tensor[picked] = values[torch.randint(len(values), (picked.numel(),), generator=g)]
    chooser = Chooser(Algorithm.AUTO, 256, WORLD)
    shares = chooser.densities(KIND, tensor)
    looked = tensor.view(-1, 256)
    if blocks > SAMPLE_BLOCKS:
        looked = looked[chooser._samples[KIND]]
    assert sorted(shares) == [16, 32, 64, 128, 256]
    for b, share in shares.items():
        sub = looked.reshape(-1, b)
        expected = (sub != 0).any(1).sum().item() / len(sub)       # NaN != 0, -0.0 == 0
        assert share == pytest.approx(expected, abs=1e-12), b
        assert 0 < share < 1


def rows_touched(rows: int, width: int, touched: int, seed: int = 0) -> torch.Tensor:
    """A dense embedding gradient: `touched` random rows of `width` non-zero, the rest zero."""
    grad = torch.zeros(rows, width)
    picked = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))[:touched]
    grad[picked] = torch.rand(touched, width, generator=torch.Generator().manual_seed(seed)) + 1
    return grad


def test_block_sizes_follow_entries_and_rows():
    assert candidate_block_sizes(256) == [256, 128, 64, 32, 16]
    assert candidate_block_sizes(48) == [48, 24]
    # blocks and rows tile, so that a stored row whose sum is zero is listed (a prime width: blocks of 1)
    assert [entry_block_size(w, 256) for w in (1, 5, 16, 32, 64, 256, 300, 384, 1024, 1009, 514)] == \
        [1, 5, 16, 32, 64, 256, 150, 192, 256, 1, 2]
    assert entry_block_size(32, 16) == 16
    # rows of a table taller than the wire's block indices number share blocks, as few as fit
    tall = (wire.MAX_BLOCKS, wire.MAX_BLOCKS + 1, 16 * wire.MAX_BLOCKS)
    assert [entry_block_size(1, 256, numel) for numel in tall] == [1, 2, 16]
    assert entry_block_size(8, 256, 8 * wire.MAX_BLOCKS + 8) == 16
    assert entry_block_size(1009, 256, 1009 * (wire.MAX_BLOCKS // 512)) == 256      # blocks of 1: too many
    chooser = Chooser(Algorithm.AUTO, 256, WORLD)
    coo = torch.sparse_coo_tensor(torch.tensor([[3, 9]]), torch.ones(2, 32), (100, 32),
                                  check_invariants=True)
    assert chooser.block_size((3200, 0, 0), coo) == 32
    for width, touched, expected in ((32, 300, 32), (16, 300, 16), (64, 300, 64),
                                     (32, 65_536, 256), (256, 300, 256)):
        chooser = Chooser(Algorithm.AUTO, 256, WORLD)
        grad = rows_touched(65_536 * 32 // width, width, touched)
        kind = (grad.numel(), 0, 0)
        assert chooser.block_size(kind, grad) == 256               # before it saw a result
        chooser.learn(kind, grad, Algorithm.SPARSE, 0.01)
        assert chooser.block_size(kind, grad) == expected, (width, touched)


def test_rows_that_straddle_blocks_keep_their_width():
    """A DDP bucket puts a table behind other parameters, so its rows of 32 start off the block
    grid and each touches two 32-element blocks or three 16-element ones: 25% fewer bytes for 1.5
    times the blocks does not pay, so the kind keeps 32. Rows on the 16-element grid touch two of
    either: 16 halves the bytes."""
    rows = rows_touched(65_536, 32, 300)
    for offset, expected in ((0, 32), (1, 32), (7, 32), (16, 16)):
        grad = torch.cat([torch.zeros(offset), rows.reshape(-1)])
        chooser = Chooser(Algorithm.AUTO, 256, WORLD)
        kind = (grad.numel(), 0, 0)
        chooser.learn(kind, grad, Algorithm.SPARSE, 0.01)
        assert chooser.block_size(kind, grad) == expected, offset


def test_block_size_stays_while_it_is_near_the_best():
    """Rows of 64, a share of them with only their first 32 elements non-zero: with a quarter of
    them so, 64-element blocks cost least and 32 is within SLACK. A kind that had 32 (every touched
    row half empty) keeps it; a new kind takes the larger; once 32 is clearly worse (every row full)
    the kind moves."""
    def grad(half_share):
        g = rows_touched(32_768, 64, 16_384, seed=3)   # half the rows: never clearly sparse
        touched = g.ne(0).any(dim=1).nonzero().flatten()
        g[touched[:int(len(touched) * half_share)], 32:] = 0
        return g
    kind = (32_768 * 64, 0, 0)
    fresh = Chooser(Algorithm.AUTO, 256, WORLD)
    fresh.learn(kind, grad(0.25), Algorithm.SPARSE, 0.01)
    assert fresh.block_size(kind, grad(0.25)) == 64
    chooser = Chooser(Algorithm.AUTO, 256, WORLD)
    for half_share, expected in ((1.0, 32), (0.25, 32), (0.0, 64), (0.25, 64)):
        chooser.learn(kind, grad(half_share), Algorithm.SPARSE, 0.01)
        assert chooser.block_size(kind, grad(half_share)) == expected, half_share


def test_narrow_rows_ship_at_their_own_granularity(store):
    """An embedding gradient with rows of 32: from the second call of its kind the blocks are its
    rows, so a rank sends a fraction of what 256-element blocks cost, and the sums stay exact."""
    def body(r, comm):
        sent = []
        for step in range(3):
            grad = rows_touched(65_536, 32, 400, seed=10 * step + r)
            before = comm.stats.bytes_sent
            comm.allreduce(grad)
            sent.append(comm.stats.bytes_sent - before)
            reference = rows_touched(65_536, 32, 400, seed=10 * step) + \
                rows_touched(65_536, 32, 400, seed=10 * step + 1)
            assert torch.equal(grad, reference)
        coo = rows_touched(65_536, 32, 400, seed=r).to_sparse(1)
        before = comm.stats.bytes_sent
        result = comm.allreduce_coo(coo)
        assert torch.equal(result.to_dense(), rows_touched(65_536, 32, 400, seed=0)
                           + rows_touched(65_536, 32, 400, seed=1))
        return sent + [comm.stats.bytes_sent - before]
    for first, second, third, coo in run_ranks(store, 2, body).values():
        assert second < first / 3 and third < first / 3
        assert coo < first / 3


def test_parse_names_the_choices():
    assert Algorithm.parse(" Ring ") is Algorithm.RING
    for wrong in ("fast", "gather"):     # gather is the chooser's, not a mode
        with pytest.raises(ValueError, match="must be one of auto, sparse, ring, got"):
            Algorithm.parse(wrong)


# ---- ranks on threads -----------------------------------------------------------------------------

def run_ranks(store, world: int, body, timeout: float = 10.0, **options) -> dict:
    """body(rank, comm) on `world` in-process ranks; {rank: its return value or its exception}."""
    results = {}

    def rank(r):
        try:
            with Communicator(store, r, world, timeout=timeout, host="127.0.0.1", **options) as comm:
                results[r] = body(r, comm)
        except Exception as exc:
            results[r] = exc
    on_threads(rank, world, timeout=timeout * 4)
    return results


def assert_mismatch_on_every_rank(results: dict, text: str = "different tensors or ops") -> None:
    for r, outcome in results.items():
        assert isinstance(outcome, MismatchError), (r, outcome)
        assert text in str(outcome), (r, outcome)


def small_coo(rank: int, call: int, rows: int, width: int, dtype) -> torch.Tensor:
    """Rank `rank`'s COO gradient of a (rows, width) table in call `call`: a few random rows, one
    of them shared by every rank, small integer values (exact sums), rank 1's rows none at call 2,
    and at call 3 a stored row of zeros on rank 0 (gloo's sum lists it)."""
    g = torch.Generator().manual_seed(100 * call + rank)
    picked = torch.randperm(rows, generator=g)[:3 + rank].tolist() + [rows // 2]
    if rank == 1 and call == 2:
        picked = []
    values = torch.randint(-4, 5, (len(picked), width), generator=g).to(dtype)
    if rank == 0 and call == 3:
        picked, values = picked + [rows - 1], torch.cat([values, torch.zeros(1, width, dtype=dtype)])
    return torch.sparse_coo_tensor(torch.tensor([picked], dtype=torch.int64).view(1, -1), values,
                                   (rows, width), check_invariants=True).coalesce()


@pytest.mark.parametrize("rows, width", [(1000, 64), (1000, 8), (20, 8), (40, 257)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_small_coo_tensor_sums_like_glooss_sparse_sum_on_every_path(store, rows, width, dtype):
    """A COO tensor small enough to gather is timed on the sparse path, the ring and gathered, as
    one dense buffer of its values and a mark per entry on gloo's paths (densified.py): on each the
    result lists the entries some rank stored and their sums, a stored row of zeros too (rows of 8
    are blocks of 8, rows of 257, prime, blocks of 1: none shares a block, which could not tell such
    a row from one nobody stored). A tiny one (20 rows of 8: 180 elements with the marks) goes to
    the ring in one round, untimed."""
    world, calls = 2, 3 * SMALL_TRIALS + 3

    def body(rank, comm):
        taken = []
        for call in range(calls):
            before = comm.stats.ring_collectives
            total = comm.allreduce_coo(small_coo(rank, call % 4, rows, width, dtype))
            taken.append(comm.stats.ring_collectives > before)
            inputs = [small_coo(r, call % 4, rows, width, dtype) for r in range(world)]
            reference = functools.reduce(torch.add, (t.double() for t in inputs)).coalesce()
            listed = sorted(set().union(*(t.indices()[0].tolist() for t in inputs)))
            if entries_share_blocks(width, entry_block_size(width, 256)):   # those whose sum is zero: not listed
                dense = reference.to_dense()
                listed = [i for i in listed if bool(dense[i].ne(0).any())]    # NaN holds something
            assert total.is_coalesced() and total.dtype == dtype and total.shape == (rows, width)
            assert total.indices()[0].tolist() == listed, (rank, call)
            assert torch.equal(total.to_dense().double(), reference.to_dense()), (rank, call)
        return taken

    results = run_ranks(store, world, body)
    assert results[0] == results[1], results       # every rank took the same paths
    taken = results[0]
    if rows * (width + 1) <= TINY_NUMEL:
        assert all(taken)
    else:
        assert not any(taken[:SMALL_TRIALS]) and all(taken[SMALL_TRIALS:3 * SMALL_TRIALS + 1])


def test_small_coo_tensors_of_different_tables_on_gloos_paths_are_a_mismatch_on_every_rank(store):
    """Past its sparse trials a small COO kind goes to the ring as its dense buffer: a rank whose
    table has another shape (the same elements, other rows) calls another kind, and every rank gets
    MismatchError, none a sum of mismatched tables."""
    def body(rank, comm):
        for call in range(SMALL_TRIALS):
            comm.allreduce_coo(small_coo(rank, call, 1000, 64, torch.float32))
        rows, width = (1000, 64) if rank == 0 else (2000, 32)
        comm.allreduce_coo(small_coo(rank, 0, rows, width, torch.float32))
    assert_mismatch_on_every_rank(run_ranks(store, 2, body))


@pytest.mark.parametrize("other", ["coo (4, 5)", "dense 24"])
def test_coo_tensors_whose_buffers_have_one_size_are_a_mismatch_not_a_sum(store, other):
    """A tiny COO tensor goes to the ring in one round as its dense buffer (its values and a mark per
    row): a (3, 7) table and a (4, 5) one both make 24 elements, and a dense tensor of 24 elements
    is as long. The check compared only the buffers, and each rank got garbage (values read as
    marks) without an error; it now carries the COO tensor's own elements too."""
    def body(rank, comm):
        if rank == 0:
            return comm.allreduce_coo(small_coo(0, 0, 3, 7, torch.float32))
        if other == "dense 24":
            return comm.allreduce(torch.ones(24))
        return comm.allreduce_coo(small_coo(1, 0, 4, 5, torch.float32))
    assert_mismatch_on_every_rank(run_ranks(store, 2, body))


@pytest.mark.parametrize("algorithm", ["ring", "sparse"])
def test_a_float16_average_whose_sum_overflows_is_the_average_on_every_path(store, algorithm):
    """40000 on each of 2 ranks: the sum (80000) is beyond float16's 65504, the average is not.
    gloo's ring summed float16 in float16 and divided after: infinity, where the sparse path (which
    sums in float32) gave 40000. The ring now sums the ranks' shares."""
    def body(rank, comm):
        t = torch.full((4096,), 40000.0, dtype=torch.float16)
        comm.allreduce(t, op="avg")
        return t.unique().tolist(), comm.stats.ring_collectives
    for rank, (values, ring_calls) in run_ranks(store, 2, body, algorithm=algorithm).items():
        assert values == [40000.0] and (ring_calls == 1) == (algorithm == "ring"), (rank, values, ring_calls)


def test_a_tiny_sum_beyond_its_dtype_or_of_opposite_infinities_is_as_glooss_without_a_warning(store):
    """gloo's ring gives infinity and NaN, silently. The tiny call's round sums in float64, and
    casting a sum beyond float32 back raised numpy's "overflow encountered in cast" RuntimeWarning in
    the caller's program (an error here, as under `-W error`); so would adding opposite infinities
    (an fp16 loss scaler's overflow step has them)."""
    def body(rank, comm):
        t = torch.tensor([3e38, math.inf if rank == 0 else -math.inf, 1.0])   # float32's largest: 3.4e38
        comm.allreduce(t)
        return t.tolist(), comm.stats.ring_collectives
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        outcomes = run_ranks(store, 2, body, algorithm="ring")
    for rank, (values, ring_calls) in outcomes.items():
        assert values[0] == math.inf and math.isnan(values[1]) and values[2] == 2.0, (rank, values)
        assert ring_calls == 1, (rank, ring_calls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_every_path_sums_like_a_reference(store, dtype):
    world = 3
    inputs = {
        "tiny": [torch.arange(10, dtype=torch.float64).to(dtype) * (r + 1) for r in range(world)],
        "dense": [with_density(BIG, 1.0, seed=r).to(dtype) for r in range(world)],
        "sparse": [with_density(BIG, 0.05, seed=10 + r).to(dtype) for r in range(world)],
    }
    order = ["tiny"] + ["dense"] * (TRIALS + 1) + ["sparse", "sparse", "dense"]
    # the path each call takes: tiny always on the ring; "dense" and "sparse" are one kind: timed
    # on the sparse path TRIALS times once dense (its first call too), then on the ring, until a
    # sparse result ends the trials
    expected_ring = [True] + [False] * TRIALS + [True, True, False, False]

    def body(r, comm):
        out = []
        for name in order:
            tensor = inputs[name][r].clone()
            before = comm.stats.ring_collectives
            comm.allreduce(tensor, op="avg" if name == "tiny" else "sum")
            out.append((tensor, comm.stats.ring_collectives > before))
        return out
    results = run_ranks(store, world, body)
    for r in range(world):
        assert not isinstance(results[r], Exception), results[r]
        assert [ring for _, ring in results[r]] == expected_ring
        for (tensor, _), name in zip(results[r], order):
            reference = sum(t.double() for t in inputs[name])
            if name == "tiny":
                reference = reference / world
            tolerance = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6
            torch.testing.assert_close(tensor.double(), reference, rtol=tolerance, atol=tolerance)
            torch.testing.assert_close(tensor, results[0][order.index(name)][0])


@pytest.mark.parametrize("dtype,op", [(torch.float32, "sum"), (torch.float16, "avg")])
def test_a_gathered_kind_sums_like_a_reference_and_alike_on_every_rank(store, dtype, op):
    """A dense kind of GATHERABLE elements over 2 ranks: its trials include gathered calls, and the
    path chosen after them (gathered or not) keeps the sums exact and identical on every rank."""
    world, calls = 2, 3 * SMALL_TRIALS + 3
    inputs = [[(torch.randn(GATHERABLE, generator=torch.Generator().manual_seed(10 * i + r)) + 4)
               .to(dtype) for r in range(world)] for i in range(calls)]

    def body(r, comm):
        out = []
        for i in range(calls):
            tensor = inputs[i][r].clone()
            comm.allreduce(tensor, op=op)
            out.append(tensor)
        return out, comm.stats
    results = run_ranks(store, world, body)
    for r in range(world):
        assert not isinstance(results[r], Exception), results[r]
        out, stats = results[r]
        assert stats.ring_gathered >= SMALL_TRIALS      # the gather trials, at least
        assert stats.ring_gathered == results[0][1].ring_gathered
        for i, tensor in enumerate(out):
            reference = sum(t.double() for t in inputs[i]) / (world if op == "avg" else 1)
            tolerance = 1e-2 if dtype is torch.float16 else 1e-6
            torch.testing.assert_close(tensor.double(), reference, rtol=tolerance, atol=tolerance)
            assert torch.equal(tensor, results[0][0][i])


def test_a_rank_that_leaves_an_expected_gathered_call_is_a_mismatch_on_every_rank(store):
    """The trials of a gatherable kind (4 sparse, 4 ring, 4 gathered): every rank expects another
    gathered call, whose round carries its data; rank 1 makes a tiny call instead. Both raise
    MismatchError from that round; nobody aborts, and nobody waits for the timeout, closing
    included."""
    def body(r, comm):
        big = torch.ones(GATHERABLE)
        for _ in range(3 * SMALL_TRIALS):
            comm.allreduce(big.fill_(1))
        # the first two ring allreduces waited for their checks, the later ones were expected;
        # gathered calls never wait
        assert comm.stats.ring_gathered == SMALL_TRIALS and comm.stats.ring_checked_first == 2
        start = time.monotonic()
        try:
            comm.allreduce(big if r == 0 else torch.ones(8))
        finally:
            body.elapsed[r] = time.monotonic() - start
    body.elapsed = {}
    start = time.monotonic()
    results = run_ranks(store, 2, body, timeout=30.0)
    assert time.monotonic() - start < 10.0
    assert_mismatch_on_every_rank(results)
    assert "gathered" in str(results[1])        # rank 0's call, as rank 1 reports it
    assert max(body.elapsed.values()) < 10.0


def test_the_ring_writes_into_views_and_tensors_that_require_grad(store):
    def body(r, comm):
        base = torch.ones(4, 600) * (r + 1)
        column = base[:, 1]                       # not contiguous
        comm.allreduce(column)
        leaf = torch.full((2000,), float(r + 1), requires_grad=True)
        for _ in range(SMALL_TRIALS + 1):         # the last one takes the ring (a small kind:
            # SMALL_TRIALS on the sparse path first)
            leaf.data.fill_(r + 1)
            comm.allreduce(leaf)
        return base, leaf.detach(), comm.stats.ring_collectives
    results = run_ranks(store, 2, body)
    for base, leaf, rings in results.values():
        assert torch.equal(base[:, 1], torch.full((4,), 3.0))
        assert torch.equal(base[:, 0], base[:, 0].new_full((4,), base[0, 0].item()))  # untouched
        assert torch.equal(leaf, torch.full((2000,), 3.0))
        assert rings == 2


@pytest.mark.parametrize("case", ["numel", "dtype", "op"])
def test_ranks_that_disagree_on_a_tiny_call_all_get_mismatch_error(store, case):
    def body(r, comm):
        tensor = torch.ones(8 + (r if case == "numel" else 0),
                            dtype=torch.float64 if case == "dtype" and r else torch.float32)
        comm.allreduce(tensor, op="avg" if case == "op" and r else "sum")
    assert_mismatch_on_every_rank(run_ranks(store, 2, body))


def test_a_mismatch_names_the_ranks_whose_call_differs_and_their_calls(store):
    """Every rank holds every rank's check buffer: the error says who called what."""
    def body(r, comm):
        comm.allreduce(torch.ones(9 if r == 2 else 8))
    results = run_ranks(store, 3, body)
    assert_mismatch_on_every_rank(results)
    for r in (0, 1):
        text = str(results[r])
        assert "this rank: allreduce 1: 8 elements of torch.float32, op sum" in text, text
        assert "rank 2: allreduce 1: 9 elements of torch.float32, op sum" in text, text
        assert f"rank {1 - r}:" not in text.split("this rank")[1], text   # it agrees
    text = str(results[2])
    assert "this rank: allreduce 1: 9 elements" in text, text
    assert "rank 0: allreduce 1: 8 elements" in text and "rank 1: allreduce 1: 8 elements" in text


def test_ranks_that_disagree_on_a_large_ring_call_all_get_mismatch_error(store):
    """Both kinds take the ring: the first, fixed-size round tells every rank."""
    def body(r, comm):
        a, b = torch.ones(BIG), torch.ones(BIG + 256)
        for tensor in (a, b) * (TRIALS + 1):      # both kinds dense: their last calls take the ring
            comm.allreduce(tensor.fill_(1))
        assert comm.stats.ring_collectives == 2
        comm.allreduce(a if r == 0 else b)
    assert_mismatch_on_every_rank(run_ranks(store, 2, body))


def test_a_large_ring_call_against_a_tiny_one_is_a_mismatch_not_an_abort(store):
    """gloo aborts the process when buffer sizes differ; every ring call starts with the same one."""
    def body(r, comm):
        big = torch.ones(BIG)
        for _ in range(3):
            comm.allreduce(big.fill_(1))
        comm.allreduce(big if r == 0 else torch.ones(5))
    assert_mismatch_on_every_rank(run_ranks(store, 2, body))


def test_a_repeating_sequence_of_ring_calls_stops_waiting_for_its_checks(store):
    """Calls that follow each other as they did last time (a DDP step's buckets) start their data
    with their check; sums stay exact, tiny calls and a new order in between included."""
    world = 3
    sizes = [BIG, 3 * BIG, 8, BIG, 3 * BIG, 8, BIG, 3 * BIG, 8, 2 * BIG, BIG, 3 * BIG]
    inputs = [[torch.randn(n, generator=torch.Generator().manual_seed(100 * i + r))
               for r in range(world)] for i, n in enumerate(sizes)]

    def body(r, comm):
        out = []
        for i in range(len(sizes)):
            tensor = inputs[i][r].clone()
            comm.allreduce(tensor)
            out.append(tensor)
        return out, comm.stats
    results = run_ranks(store, world, body, algorithm="ring")
    for r in range(world):
        assert not isinstance(results[r], Exception), results[r]
        out, stats = results[r]
        for i, tensor in enumerate(out):
            reference = sum(t.double() for t in inputs[i])
            torch.testing.assert_close(tensor.double(), reference, rtol=1e-5, atol=1e-5)
            assert torch.equal(tensor, results[0][0][i])
        # waited: the first three large calls (what follows a kind is learned when it follows),
        # 2*BIG (not the expected BIG) and the BIG after it (nothing had followed 2*BIG before);
        # the 3*BIG after that BIG was expected again
        assert stats.ring_collectives == len(sizes)
        assert stats.ring_checked_first == 5


@pytest.mark.parametrize("case", ["numel", "dtype", "tiny"])
def test_a_rank_whose_call_differs_from_the_expected_one_is_a_mismatch_on_every_rank(store, case):
    """Every rank expects the same large call next: rank 0 makes it and starts its data at once,
    rank 1 makes another. Both get MismatchError from the check round, long before the timeout,
    and nobody aborts (in-process ranks: gloo's abort would end the test run)."""
    def body(r, comm):
        big = torch.ones(BIG)
        for _ in range(3):
            comm.allreduce(big.fill_(1))
        assert comm.stats.ring_checked_first == 2       # the third started with its check
        other = {"numel": torch.ones(BIG + 256), "dtype": torch.ones(BIG, dtype=torch.float64),
                 "tiny": torch.ones(8)}[case]
        start = time.monotonic()
        try:
            comm.allreduce(big if r == 0 else other)
        finally:
            body.elapsed[r] = time.monotonic() - start
    body.elapsed = {}
    assert_mismatch_on_every_rank(run_ranks(store, 2, body, timeout=30.0, algorithm="ring"))
    assert max(body.elapsed.values()) < 10.0


def test_after_a_mismatch_nothing_writes_the_tensor_whose_data_had_started(store):
    """Ranks 0 and 1 make the expected call and start its data beside its check; rank 2 makes
    another. When rank 0's MismatchError returns, gloo no longer writes rank 0's tensor: what rank 0
    writes into it then stays (before, gloo's sum of ranks 0 and 1 with rank 2's zero partner could
    land after it)."""
    def body(r, comm):
        big = torch.ones(BIG)
        for _ in range(3):
            comm.allreduce(big.fill_(1))
        try:
            comm.allreduce(big if r < 2 else torch.ones(BIG + 256))
        except MismatchError:
            if r == 0:
                big.fill_(5)
        time.sleep(0.2)     # rank 2's zero partner (a 1 MB ring on loopback) would have ended by now
        return big
    results = run_ranks(store, 3, body, timeout=30.0, algorithm="ring")
    assert not isinstance(results[0], Exception), results[0]
    assert torch.equal(results[0], torch.full((BIG,), 5.0))


def test_a_rank_that_rejects_its_input_releases_peers_waiting_on_the_ring(store):
    """Rank 1 refuses its own call (an integer tensor); rank 0 is already in gloo's ring for that
    collective and hears of it through the aggregators long before the timeout."""
    def body(r, comm):
        start = time.monotonic()
        tensor = torch.ones(8) if r == 0 else torch.ones(8, dtype=torch.int32)
        try:
            comm.allreduce(tensor)
        finally:
            elapsed = time.monotonic() - start
        return elapsed
    results = run_ranks(store, 2, body, timeout=20.0)
    assert isinstance(results[1], TypeError)
    assert isinstance(results[0], SparcollError), results[0]
    assert "rank 1" in str(results[0]) and "rejected its input" in str(results[0])


def test_ranks_on_different_paths_get_mismatch_error_at_once(store):
    """A kind rank 0 learned dense and rank 1 never saw: rank 0 takes the ring, rank 1 the sparse
    path. Rank 0's own aggregator receives rank 1's part: both raise MismatchError long before
    the timeout."""
    def body(r, comm):
        a = torch.ones(BIG)
        for _ in range(3):                        # dense: the next call of this kind takes the ring
            comm.allreduce(a.fill_(1))
        start = time.monotonic()
        try:
            comm.allreduce(torch.ones(BIG) if r == 0 else torch.ones(BIG + 256))
        finally:
            body.elapsed[r] = time.monotonic() - start
    body.elapsed = {}
    assert_mismatch_on_every_rank(run_ranks(store, 2, body, timeout=30.0), "sparse AllReduce")
    assert max(body.elapsed.values()) < 10.0


def test_ranks_on_different_paths_with_dedicated_aggregators_fail_within_the_timeout(
        store, dedicated_in_process):
    """With dedicated aggregators nothing tells the ring rank: both fail by the timeout, not hang."""
    def body(r, comm):
        start = time.monotonic()
        try:
            comm.allreduce(torch.ones(8) if r == 0 else torch.ones(BIG))
        finally:
            body.elapsed[r] = time.monotonic() - start
    body.elapsed = {}
    results = run_ranks(store, 2, body, timeout=3.0, aggregators=dedicated_in_process)
    for r in range(2):
        assert isinstance(results[r], SparcollError), results[r]
        assert body.elapsed[r] < 3.0 + 5.0


def test_ranks_must_agree_on_the_algorithm(store):
    def rank(r):
        with pytest.raises(MismatchError):
            Communicator(store, r, 2, timeout=10, host="127.0.0.1",
                         algorithm="ring" if r else "auto").close()
    on_threads(rank, 2, timeout=40)


def test_forced_sparse_never_builds_a_ring(store):
    results = run_ranks(store, 2, lambda r, comm: (comm.allreduce(torch.ones(8)), comm.stats),
                        algorithm="sparse")
    for tensor, stats in results.values():
        assert torch.equal(tensor, torch.full((8,), 2.0))
        assert stats.ring_collectives == 0 and stats.collectives == 1


def peer_dies_during_ring(rank: int, world: int) -> dict:
    """Rank 1 leaves (os._exit) after one allreduce; rank 0's next one, on gloo's ring (forced: the
    default takes a kind's first collectives to the sparse path), must fail with a SparcollError
    well before its 30 s timeout."""
    import os

    import sparcoll

    comm = sparcoll.init(timeout=30, algorithm="ring")
    comm.allreduce(torch.ones(1 << 20))     # beyond the tiny and gathered sizes: gloo's ring itself
    if rank == 1:
        time.sleep(0.5)                     # rank 0's next call has started
        os._exit(0)
    start = time.monotonic()
    try:
        comm.allreduce(torch.ones(1 << 20))
        return {"error": None}
    except SparcollError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    finally:
        comm.close()


def test_a_peer_that_dies_during_a_ring_collective_fails_it_at_once():
    from ranks import run_ranks as run_processes

    survivor, = run_processes(peer_dies_during_ring, 2, timeout=90, dying=1)
    assert survivor["error"] is not None, survivor
    assert survivor["seconds"] < 15, survivor


class CompletedWork:
    """A gloo Work that completed just as a wait slice timed out: the slice raises anyway."""

    def __init__(self, failure: BaseException | None):
        self.failure = failure

    def wait(self, timeout=None):
        if timeout is not None:
            raise RuntimeError("Operation timed out!")
        if self.failure is not None:
            raise self.failure
        return True

    def is_completed(self):
        return True


@pytest.mark.parametrize("failure", [None, RuntimeError("Connection reset by peer")])
def test_a_wait_slice_that_times_out_as_the_allreduce_completes_is_not_a_failure(failure):
    from sparcoll.errors import PeerError
    from sparcoll.ring import Ring

    ring = object.__new__(Ring)     # only _wait is under test: no gloo group needed
    ring.rank = 0
    ring.star = types.SimpleNamespace(closed_peers=lambda: [1])     # rank 1's link is closed
    deadline = time.monotonic() + 5.0
    if failure is None:
        ring._wait(CompletedWork(failure), deadline, lambda: None)
    else:   # gloo names an address, the star's closed link the rank
        with pytest.raises(PeerError, match=r"\(rank 1 closed its connection: died or left\): "
                                            r"Connection reset by peer"):
            ring._wait(CompletedWork(failure), deadline, lambda: None)


# ---- the guarded ring alone ------------------------------------------------------------------------

def run_rings(store, world: int, body, timeout: float = 10.0) -> dict:
    """body(rank, ring) on `world` in-process Rings; {rank: its return value or its exception}.
    Each ring counts the check rounds it joins (`check_rounds`)."""
    import torch.distributed as dist
    from sparcoll.ring import Ring
    from sparcoll.star import Credentials
    results = {}

    def rank(r):
        credentials = Credentials(7, wire.JobConfig(world, world, 1, 1, 1), b"s" * 32)
        ring = Ring(dist.PrefixStore("rings", store), r, world, timeout, "127.0.0.1", credentials)
        ring.check_rounds, star_round = 0, ring.star.round

        def counted(*args):
            ring.check_rounds += 1
            return star_round(*args)
        ring.star.round = counted
        try:
            results[r] = body(r, ring)
        except Exception as exc:
            results[r] = exc
        finally:
            ring.close()
    on_threads(rank, world, timeout=timeout * 4)
    return results


@pytest.mark.parametrize("world,dtype,op", [(2, torch.float32, wire.Op.SUM),
                                             (3, torch.float32, wire.Op.SUM),
                                             (2, torch.float16, wire.Op.AVG),
                                             (4, torch.bfloat16, wire.Op.AVG)])
def test_gathered_calls_carry_their_data_in_their_check_round(store, world, dtype, op):
    """A gathered call's data travels in its check round, from the first call on: one round a
    call, none waits for a check first, and the sums (rank 0's) are exact and the same on every
    rank."""
    numel, calls = 5000, 5
    inputs = [[(torch.randn(numel, generator=torch.Generator().manual_seed(10 * i + r)) + 4)
               .to(dtype) for r in range(world)] for i in range(calls)]

    def body(r, ring):
        out = []
        for i in range(calls):
            tensor = inputs[i][r].clone()
            ring.allreduce(i + 1, tensor, op, 10.0, lambda: None, gather=True)
            out.append(tensor)
        return out, ring.checked_first, ring.gathered, ring.check_rounds
    results = run_rings(store, world, body)
    tolerance = 1e-5 if dtype is torch.float32 else 1e-2
    for r in range(world):
        assert not isinstance(results[r], Exception), results[r]
        out, checked_first, gathered, check_rounds = results[r]
        assert (checked_first, gathered, check_rounds) == (0, calls, calls)
        for i, tensor in enumerate(out):
            reference = sum(t.double() for t in inputs[i]) / (world if op == wire.Op.AVG else 1)
            torch.testing.assert_close(tensor.double(), reference, rtol=tolerance, atol=tolerance)
            assert torch.equal(tensor, results[0][0][i])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", ["numel", "tiny", "allreduce"])
def test_a_rank_that_leaves_a_gathered_call_all_expect_is_a_mismatch_on_every_rank(store, case,
                                                                                    world):
    """Every rank expects a third gathered call; rank 1 makes another (more elements, a tiny one,
    or the same tensor allreduced). Its round carries its own call's fields, so every rank raises
    MismatchError from that one round, promptly, and nobody aborts."""
    numel = 5000

    def body(r, ring):
        for cid in (1, 2):
            ring.allreduce(cid, torch.ones(numel), 0, 10.0, lambda: None, gather=True)
        tensor, gather = torch.ones(numel), True
        if r == 1:
            tensor = {"numel": torch.ones(numel + 8), "tiny": torch.ones(8),
                      "allreduce": tensor}[case]
            gather = case != "allreduce"
        ring.allreduce(3, tensor, 0, 10.0, lambda: None, gather=gather)
    start = time.monotonic()
    results = run_rings(store, world, body, timeout=30.0)
    assert time.monotonic() - start < 10.0
    assert_mismatch_on_every_rank(results)
    assert "rank 1: allreduce 3: " in str(results[0])


@pytest.mark.parametrize("case", ["tiny", "allreduce", "numel"])
def test_ranks_that_all_leave_a_gathered_call_they_expected_for_the_same_call_sum_it(store, case):
    """Every rank expects a third gathered call and every rank makes the same other one: it is
    summed its own way, exactly."""
    world, numel = 3, 5000
    sizes = {"tiny": 8, "allreduce": numel, "numel": numel + 8}
    inputs = [torch.randn(sizes[case], generator=torch.Generator().manual_seed(r))
              for r in range(world)]

    def body(r, ring):
        for cid in (1, 2):
            ring.allreduce(cid, torch.ones(numel), 0, 10.0, lambda: None, gather=True)
        tensor = inputs[r].clone()
        ring.allreduce(3, tensor, 0, 10.0, lambda: None, gather=case == "numel")
        return tensor
    results = run_rings(store, world, body)
    reference = sum(t.double() for t in inputs)
    for r in range(world):
        assert not isinstance(results[r], Exception), results[r]
        torch.testing.assert_close(results[r].double(), reference, rtol=1e-5, atol=1e-5)
        assert torch.equal(results[r], results[0])


@pytest.mark.parametrize("world", [3, 4])
def test_a_check_round_whose_calls_agree_sends_one_row_of_fields_at_any_world(store, world):
    """Where every rank made the same call, rank 0's verdict holds one row of fields (the call, the
    next call expected, the ranks' averages of the shared numbers), whatever the world: it held every
    rank's row, 136 x world bytes to each rank, 551 KB from rank 0 a small call at 64 ranks (a
    review). The averages are still every rank's, and a next call one rank expects otherwise is
    expected by none: each such call waits for its check on every rank."""
    from sparcoll import ring as ring_module
    head = ring_module._ROWS + ring_module._HEAD * 8
    calls = 4

    def body(r, ring):
        lengths, star_round = [], ring.star.round
        ring.star.round = lambda *args: (lambda verdict: lengths.append(len(verdict)) or verdict)(star_round(*args))
        tiny = torch.full((8,), float(r))
        shared = ring.allreduce(1, tiny, wire.Op.SUM, 10.0, lambda: None, share=[r, 2.0 * r, 1.0])
        if r == world - 1:      # this rank alone expects some other call after each
            learn = ring._next
            ring._next = lambda call: learn(call) and (call[0] + 1, 3, *call[2:])
        for i in range(calls):
            ring.allreduce(2 + i, torch.ones(BIG), wire.Op.SUM, 10.0, lambda: None)
        return tiny, shared, lengths, ring.checked_first
    results = run_rings(store, world, body)
    for r in range(world):
        assert not isinstance(results[r], Exception), results[r]
        tiny, shared, lengths, checked_first = results[r]
        assert torch.equal(tiny, torch.full((8,), float(sum(range(world)))))
        assert shared == [(world - 1) / 2, world - 1.0, 1.0]
        assert lengths == [head + 8 * 8] + [head] * calls, lengths
        assert checked_first == calls, checked_first


def test_a_mismatch_verdict_still_holds_every_ranks_fields(store):
    """The verdict of a round whose calls differ holds every rank's fields: each rank names the
    others' calls from it (test_a_mismatch_names_the_ranks_whose_call_differs_and_their_calls)."""
    from sparcoll import ring as ring_module

    def body(r, ring):
        lengths, star_round = [], ring.star.round
        ring.star.round = lambda *args: (lambda verdict: lengths.append(len(verdict)) or verdict)(star_round(*args))
        with pytest.raises(MismatchError):
            ring.allreduce(1, torch.ones(9 if r == 3 else 8), wire.Op.SUM, 10.0, lambda: None)
        return lengths
    results = run_rings(store, 4, body)
    for r in range(4):
        assert results[r] == [ring_module._ROWS + 4 * ring_module._HEAD * 8], results[r]
