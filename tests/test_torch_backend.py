"""The "sparcoll" torch.distributed backend on 2 ranks in processes of their own: collectives against
expected values, errors raised in the caller, and DDP on it against a single-process full-batch reference (the DDP
cases are in scenarios.py, shared with test_hooks.py).
"""
import copy
import os
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ranks import run_ranks
from scenarios import (all_cases_vs_reference, assert_all_match, assert_half_precision_mean,
                       half_precision_vs_float64, mlp)
from support import outcome_of

pytestmark = pytest.mark.auto_algorithm   # as users get it (conftest.py)

TIMEOUT = 90
WORLD = 2
LATE = 1.0        # seconds rank 1 comes late to the barrier


# ---- rank bodies -------------------------------------------------------------------------------
def sparcoll_group(timeout: float = 60.0):
    import sparcoll.torch  # noqa: F401  (registers the backend)
    return dist.new_group(backend="sparcoll", timeout=timedelta(seconds=timeout))


def ddp_on_sparcoll_group(rank: int, world: int) -> dict:
    pg = sparcoll_group()
    try:
        return all_cases_vs_reference(rank, world, lambda m, opts: DDP(m, process_group=pg, **opts))
    finally:
        dist.destroy_process_group(pg)


def ddp_on_default_sparcoll_group(rank: int, world: int) -> dict:
    """Replace run_ranks's gloo default group by init_process_group(backend="sparcoll")."""
    import sparcoll.torch  # noqa: F401
    from torch.distributed import distributed_c10d as c10d

    store = dist.PrefixStore("again", c10d._get_default_store())
    # every rank's gloo group connected before any closes its own: a rank that destroyed its group
    # while a slower peer's full mesh still connected to it failed that peer's init ("Connection
    # closed by peer", once in a loaded run)
    dist.barrier()
    dist.destroy_process_group()
    dist.init_process_group("sparcoll", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    assert dist.get_backend() == "sparcoll"
    errors = all_cases_vs_reference(rank, world, lambda m, opts: DDP(m, **opts))
    out = torch.full((2,), float(rank))
    dist.all_reduce(out)
    return {**errors, "sum": out.tolist()}


class Branching(torch.nn.Module):
    """A layer used at even steps only: DDP needs find_unused_parameters."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.a, self.b, self.c = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1), torch.nn.Linear(8, 8)

    def forward(self, x, use_c: bool):
        h = torch.relu(self.a(x))
        return self.b(self.c(h) if use_c else h)


# DDP models kept until their rank's process exits (it ends with os._exit, which runs no destructor).
KEPT_UNTIL_EXIT = []


def train_under_join(rank: int, pg) -> DDP:
    """A DDP model with an unused branch every other step, trained under Join on `pg`: rank 0 runs out
    of batches after 2 steps, the others after 4."""
    from torch.distributed.algorithms.join import Join

    ddp = DDP(Branching(), process_group=pg, find_unused_parameters=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with Join([ddp]):
        for step in range(2 if rank == 0 else 4):
            g = torch.Generator().manual_seed(10 * step + rank)
            x, y = torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)
            optimizer.zero_grad()
            ((ddp(x, step % 2 == 0) - y) ** 2).mean().backward()
            optimizer.step()
    return ddp


def join_with_uneven_inputs(rank: int, world: int) -> dict:
    """DDP's Join with find_unused_parameters, rank 0 running out of batches first, on a "sparcoll" group
    and on a gloo one: the final parameters of each; and the forms of ProcessGroup.allreduce and
    barrier that torch's own code calls (DDP's join hook calls `allreduce(tensor)`).

    Each DDP model outlives the function: under Join, DDP starts all_reduces it never waits for, and
    torch 2.13 can deadlock freeing a gloo group whose worker thread still holds one (the Reducer's
    destructor joins that thread with the GIL held; the thread needs the GIL to free the work). In
    this test that hung 2 of 35 runs beside two busy loops (py-spy: ~ProcessGroupGloo in
    std::thread::join, the worker in ~AsyncWork waiting for the GIL), in the plain gloo group."""
    out = {}
    for backend in ("sparcoll", "gloo"):
        pg = sparcoll_group() if backend == "sparcoll" else dist.new_group(backend="gloo")
        ddp = train_under_join(rank, pg)
        out[backend] = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]).numpy()
        KEPT_UNTIL_EXIT.append(ddp)
        if backend == "sparcoll":
            one = torch.full((3,), float(rank + 1))
            pg.allreduce(one).wait()
            listed = [torch.full((3,), float(rank + 1))]
            pg.allreduce(listed).wait()
            largest = torch.full((3,), float(rank + 1))
            pg.allreduce(largest, dist.ReduceOp.MAX).wait()
            pg.barrier().wait()
            shared = torch.full((1,), float(rank + 1)).expand(3)    # one element's memory, as gloo takes it
            pg.allreduce(shared).wait()
            after = torch.full((3,), float(rank + 1))               # and the group goes on
            pg.allreduce(after).wait()
            out["forms"] = [one.tolist(), listed[0].tolist(), largest.tolist(), shared.tolist(), after.tolist()]
        dist.destroy_process_group(pg)
    return out


def half_precision_on_sparcoll_group(rank: int, world: int, dtype_name: str) -> dict:
    """A half-precision model under DDP on the sparcoll backend, against the float64 mean
    (scenarios.py); and how many collectives sparcoll itself ran (not handed to gloo)."""
    import sparcoll.torch

    pg = sparcoll_group()
    try:
        errors = half_precision_vs_float64(rank, world, dtype_name, lambda m: DDP(m, process_group=pg))
        return {**errors, "collectives": sparcoll.torch.stats(pg).collectives}
    finally:
        dist.destroy_process_group(pg)


def collectives(rank: int, world: int) -> dict:
    import sparcoll.torch

    pg = sparcoll_group()
    out = {}
    t = torch.arange(1000.0) * (rank + 1)
    dist.all_reduce(t, group=pg)
    out["sum"] = torch.equal(t, torch.arange(1000.0) * 3)
    traffic = sparcoll.torch.stats(pg)
    out["stats"] = (traffic.collectives, traffic.bytes_sent + traffic.ring_bytes >= 2000)
    try:
        sparcoll.torch.stats()          # run_ranks's default group is gloo's
    except ValueError as e:
        out["stats_of_gloo"] = str(e)
    # A dtype sparcoll does not reduce goes to gloo, sparse as dense; the group then still works.
    sums = [torch.sparse_coo_tensor([[rank, 3, 7]], torch.tensor([[1, 2], [3, 4], [5, 6]]) * (rank + 1), (10, 2))
            for _ in range(2)]
    dist.all_reduce(sums[0], group=pg)
    dist.all_reduce(sums[1])                        # the default group: gloo
    out["sparse_int64"] = torch.equal(sums[0].to_dense(), sums[1].to_dense())
    # so does a sparse tensor of more blocks than sparcoll's indices number (2^42 rows wrapped them)
    rows = 1 << 42
    huge = [torch.sparse_coo_tensor([[rank, rows - 1]], torch.tensor([1.0, 2.0]) * (rank + 1), (rows,))
            for _ in range(2)]
    dist.all_reduce(huge[0], group=pg)
    dist.all_reduce(huge[1])
    out["sparse_huge"] = torch.equal(huge[0].coalesce().values(), huge[1].coalesce().values()) and \
        torch.equal(huge[0].coalesce().indices(), torch.tensor([[0, 1, rows - 1]]))
    t = torch.full((300,), float(rank + 1), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=pg)
    out["avg"] = torch.equal(t, torch.full((300,), 1.5, dtype=torch.float64))
    t = torch.full((3,), rank + 1)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)                      # delegated to gloo
    out["max_int"] = t.tolist()
    table = torch.arange(12).view(3, 4) + 100 * rank
    column, every_other = table[:, 1], torch.arange(8.0) - rank
    dist.all_reduce(column, op=dist.ReduceOp.MIN, group=pg)                 # views delegated to gloo
    dist.all_reduce(every_other[::2], op=dist.ReduceOp.MAX, group=pg)
    weight = torch.nn.Parameter(torch.arange(6.0).view(2, 3) - rank)     # written back as gloo writes
    dist.all_reduce(weight.t(), op=dist.ReduceOp.MAX, group=pg)
    with torch.inference_mode():
        metric = torch.arange(6).view(2, 3) + rank
    dist.all_reduce(metric[:, 1], op=dist.ReduceOp.MIN, group=pg)
    out["views"] = [table.tolist(), every_other.tolist(), weight.tolist(), metric.tolist()]
    s = torch.sparse_coo_tensor([[rank, 2]], [1.0, 2.0], (4,))
    dist.all_reduce(s, group=pg)
    out["sparse_sum"] = s.to_dense().tolist()
    s = torch.sparse_coo_tensor([[rank, 2]], [1.0, 2.0], (4,)).requires_grad_()
    dist.all_reduce(s, group=pg)                     # as data, as a dense one that requires grad
    out["sparse_sum_requires_grad"] = s.detach().to_dense().tolist()
    s = torch.sparse_coo_tensor([[rank, 2]], [1.0, 2.0], (4,))
    dist.all_reduce(s, op=dist.ReduceOp.AVG, group=pg)
    out["sparse_avg"] = s.to_dense().tolist()
    t = torch.full((3,), float(rank))
    dist.broadcast(t, 1, group=pg)
    out["broadcast"] = t.tolist()
    parts = [torch.empty(2) for _ in range(world)]
    dist.all_gather(parts, torch.full((2,), float(rank)), group=pg)
    out["all_gather"] = [p.tolist() for p in parts]
    whole = torch.empty(2 * world)
    dist.all_gather_into_tensor(whole, torch.full((2,), float(rank)), group=pg)
    out["all_gather_into_tensor"] = whole.tolist()
    part = torch.empty(2)
    dist.reduce_scatter_tensor(part, torch.arange(2.0 * world) + rank, group=pg)
    out["reduce_scatter_tensor"] = part.tolist()
    work = dist.all_reduce(torch.ones(10), group=pg, async_op=True)
    work.wait()
    out["async_future"] = work.get_future().value()[0].tolist()
    # Logging code reduces a loss that requires grad: gloo allows it, so must the backend.
    loss = (torch.ones(5, requires_grad=True) * (rank + 1)).sum()
    dist.all_reduce(loss, group=pg)
    out["loss"] = loss.item()
    # torch's monitored_barrier refuses backends not named gloo; ours runs the inner gloo group's.
    sparcoll.torch.monitored_barrier(pg, timedelta(seconds=30), wait_all_ranks=True)
    out["monitored_barrier"] = True
    # Rank 1 comes to the barrier LATE seconds after rank 0 is known to have started waiting (the
    # default group's Store tells it so): rank 0's barrier cannot return sooner, however loaded.
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        start = time.monotonic()
        store.set("barrier/0-waiting", "1")
        dist.barrier(group=pg)
        out["barrier_waited"] = time.monotonic() - start
    else:
        store.wait(["barrier/0-waiting"], timedelta(seconds=60))
        time.sleep(LATE)
        dist.barrier(group=pg)
    dist.destroy_process_group(pg)
    return out


def mismatch(rank: int, world: int) -> dict:
    """Ranks all_reduce different sizes: both must raise, quickly; the group is then poisoned."""
    pg = sparcoll_group()
    out = {}
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(7 + rank), group=pg)
        out["error"] = None
    except Exception as exc:
        out["error"] = type(exc).__name__
    out["elapsed"] = time.monotonic() - start
    work = dist.all_reduce(torch.ones(4), group=pg, async_op=True)
    try:
        work.wait()
        out["after"] = None
    except Exception as exc:
        out["after"] = type(exc).__name__
    out["exception"] = type(work.exception()).__name__
    dist.destroy_process_group(pg)
    return out


def threads_of_blocking_and_async_calls(rank: int, world: int) -> dict:
    """Which thread runs the ring round of a blocking dist.all_reduce and of an async one, and the
    sums (a blocking one whose peer's call is async, and the other way round)."""
    import threading
    from sparcoll.torch.backend import _backend_of
    pg = sparcoll_group()
    ring = _backend_of(pg).comm._engine.ring
    threads, round_ = [], ring.star.round
    ring.star.round = lambda *args: threads.append(threading.current_thread().name) or round_(*args)
    sums = []
    for async_op in (False, True, rank == 0):
        t = torch.full((3,), float(rank + 1))
        work = dist.all_reduce(t, group=pg, async_op=async_op)
        if async_op:
            work.wait()
        sums.append(t.tolist())
    dist.destroy_process_group(pg)
    return {"threads": threads, "sums": sums, "main": threading.main_thread().name}


def test_a_blocking_all_reduce_runs_on_the_callers_thread_an_async_one_on_the_engines():
    """torch's blocking all_reduce says so in its options (asyncOp): run at once on the caller's
    thread, it skips the hand-off to the engine thread and back (a 1-float call over 2 ranks took
    1.65x gloo's through it); an async one still returns at once. Mixed across ranks, they pair."""
    for rank, out in enumerate(run_ranks(threads_of_blocking_and_async_calls, WORLD, timeout=TIMEOUT)):
        third = out["main"] if rank == 1 else "sparcoll-engine"
        assert out["threads"] == [out["main"], "sparcoll-engine", third], out
        assert out["sums"] == [[3.0] * 3] * 3, out


def barrier_against_all_reduce(rank: int, world: int) -> dict:
    """Rank 0 enters a barrier while rank 1 all_reduces one element: both must raise MismatchError,
    quickly (the barrier's sparcoll allreduce once summed with the all_reduce, which got 6.0)."""
    pg = sparcoll_group()
    start = time.monotonic()
    try:
        if rank == 0:
            dist.barrier(group=pg)
        else:
            dist.all_reduce(torch.tensor([5.0]), group=pg)
        out = {"error": None}
    except Exception as exc:
        out = {"error": f"{type(exc).__name__}: {exc}"}
    out["elapsed"] = time.monotonic() - start
    dist.destroy_process_group(pg)
    return out


def ddp_backward_fails(rank: int, world: int) -> dict:
    """Rank 0 runs DDP's backward while rank 1 all_reduces another size: rank 0's backward must raise
    (not crash the process), rank 1's all_reduce too."""
    pg = sparcoll_group()
    torch.manual_seed(0)
    model = DDP(mlp(), process_group=pg)
    out = {}
    try:
        if rank == 0:
            model(torch.randn(4, 8)).sum().backward()
        else:
            dist.all_reduce(torch.ones(5), group=pg)
        out["error"] = None
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    dist.destroy_process_group(pg)
    return out


def ddp_dense_buckets_on_the_ring(rank: int, world: int) -> dict:
    """DDP with three dense buckets for 12 iterations on gloo's ring (forced: "auto" would choose
    by timing, which the test must not depend on): their order repeats, so their data starts with
    their check rounds. Every iteration's averaged gradients against the same local gradients
    averaged by the gloo default group."""
    import sparcoll.torch
    os.environ["SPARCOLL_ALGORITHM"] = "ring"       # this rank's own environment
    pg = sparcoll_group()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
              torch.nn.ReLU(), torch.nn.Linear(512, 64)]
    model = torch.nn.Sequential(*layers)
    reference = copy.deepcopy(model)
    ddp = DDP(model, process_group=pg, bucket_cap_mb=0.5)
    largest = 0.0
    for step in range(12):
        batch = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * step + rank))
        ddp.zero_grad()
        ddp(batch).square().sum().backward()
        reference.zero_grad()
        reference(batch).square().sum().backward()
        for mine, theirs in zip(model.parameters(), reference.parameters()):
            expected = theirs.grad.clone()
            dist.all_reduce(expected)                 # the default group: gloo
            expected /= world
            largest = max(largest, ((mine.grad - expected).abs().max()
                                    / expected.abs().max().clamp_min(1e-12)).item())
    traffic = sparcoll.torch.stats(pg)
    dist.destroy_process_group(pg)
    return {"largest_relative_error": largest, "ring": traffic.ring_collectives,
            "checked_first": traffic.ring_checked_first}


def init_outside_the_group(rank: int, world: int) -> dict:
    """sparcoll.init on a group this rank is not in: a ValueError saying so (it used to be a
    ProtocolError about world=-1); the group's own member gets a working communicator."""
    import sparcoll

    group = dist.new_group([0])
    if rank == 1:
        try:
            sparcoll.init(group)
            return {"error": None}
        except ValueError as exc:
            return {"error": str(exc)}
    with sparcoll.init(group, timeout=30.0) as comm:
        return {"sum": comm.allreduce(torch.full((10,), 2.0)).tolist()}


# ---- tests -------------------------------------------------------------------------------------
def test_collectives_against_expected_values():
    outcomes = run_ranks(collectives, WORLD, timeout=TIMEOUT)
    for rank, out in enumerate(outcomes):
        assert out["sum"] and out["avg"] and out["sparse_int64"] and out["sparse_huge"], out
        assert out["max_int"] == [2, 2, 2]
        table = (torch.arange(12).view(3, 4) + 100 * rank).tolist()
        for row, value in zip(table, (1, 5, 9)):
            row[1] = value                  # the column's minimum, rank 0's; the rest untouched
        every_other = [float(i) if i % 2 == 0 else float(i - rank) for i in range(8)]
        metric = (torch.arange(6).view(2, 3) + rank).tolist()
        metric[0][1], metric[1][1] = 1, 4
        assert out["views"] == [table, every_other, torch.arange(6.0).view(2, 3).tolist(), metric], out["views"]
        assert out["sparse_sum"] == out["sparse_sum_requires_grad"] == [1.0, 1.0, 4.0, 0.0]
        assert out["sparse_avg"] == [0.5, 0.5, 2.0, 0.0]
        assert out["broadcast"] == [1.0, 1.0, 1.0]
        assert out["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert out["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0]
        assert out["reduce_scatter_tensor"] == [[1.0, 3.0], [5.0, 7.0]][rank]
        assert out["async_future"] == [2.0] * 10
        assert out["loss"] == 15.0 and out["monitored_barrier"]
        assert out["stats"] == (1, True), out["stats"]
        assert "'gloo' backend" in out["stats_of_gloo"], out
    assert outcomes[0]["barrier_waited"] >= LATE     # rank 1 came to the barrier LATE s late


def test_init_on_a_rank_outside_the_group_says_so():
    member, outsider = run_ranks(init_outside_the_group, WORLD, timeout=TIMEOUT)
    assert member == {"sum": [2.0] * 10}
    assert "not a member of the group" in (outsider["error"] or ""), outsider


def test_mismatched_all_reduce_raises_in_every_caller():
    for out in run_ranks(mismatch, WORLD, timeout=TIMEOUT):
        assert out["error"] == "MismatchError", out
        assert out["elapsed"] < 10, out
        assert out["after"] == "PoisonedError" and out["exception"] == "PoisonedError", out


def test_barrier_never_pairs_with_an_all_reduce():
    outcomes = run_ranks(barrier_against_all_reduce, WORLD, timeout=TIMEOUT)
    for out in outcomes:
        assert (out["error"] or "").startswith("MismatchError") and "tag 65535" in out["error"], out
        assert out["elapsed"] < 10, out
    # the barrier's call in words, wherever the message names it (not only as tag 65535)
    assert any("check of a barrier" in out["error"] for out in outcomes), outcomes


def test_failed_allreduce_in_ddp_backward_raises_runtime_error():
    rank0, rank1 = run_ranks(ddp_backward_fails, WORLD, timeout=TIMEOUT)
    assert rank0["error"].startswith("RuntimeError") and "MismatchError" in rank0["error"], rank0
    assert rank1["error"].startswith("MismatchError"), rank1


def test_ddp_on_new_group_matches_full_batch_reference():
    assert_all_match(run_ranks(ddp_on_sparcoll_group, WORLD, timeout=TIMEOUT))


def test_ddp_join_with_uneven_inputs_and_unused_parameters_trains_as_on_gloo():
    """It raised TypeError (allreduce() missing 'opts') on the rank that ran out of batches first: DDP's
    join hook calls the group's allreduce with a tensor alone (a review). An expand()ed tensor, which
    the Communicator refuses (and the refusal poisoned the group), goes to gloo, as on a gloo group."""
    outcomes = run_ranks(join_with_uneven_inputs, WORLD, timeout=TIMEOUT)
    for out in outcomes:
        np.testing.assert_allclose(out["sparcoll"], out["gloo"], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(out["sparcoll"], outcomes[0]["sparcoll"])
        total, largest = float(sum(range(1, WORLD + 1))), float(WORLD)
        assert out["forms"] == [[total] * 3, [total] * 3, [largest] * 3, [total] * 3, [total] * 3], out["forms"]


def test_ddp_on_default_group_matches_full_batch_reference():
    outcomes = run_ranks(ddp_on_default_sparcoll_group, WORLD, timeout=TIMEOUT)
    for out in outcomes:
        assert out.pop("sum") == [1.0, 1.0]
    assert_all_match(outcomes)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_half_precision_model_under_ddp_on_the_backend_averages_to_the_float64_mean(dtype_name):
    """DDP's half-precision buckets reduced by sparcoll itself (its own dtype codes), within the half
    type's rounding of the ranks' float64 mean."""
    for outcome in run_ranks(half_precision_on_sparcoll_group, WORLD, timeout=TIMEOUT,
                             dtype_name=dtype_name):
        assert outcome["collectives"] >= 1, outcome
        assert_half_precision_mean(outcome)


def test_ddp_buckets_on_the_ring_stop_waiting_for_their_checks_and_sum_exactly():
    for out in run_ranks(ddp_dense_buckets_on_the_ring, WORLD, timeout=TIMEOUT):
        assert out["largest_relative_error"] < 1e-5, out
        assert out["ring"] >= 12, out
        assert 1 <= out["checked_first"] <= out["ring"] // 2, out


def waits_inside_callbacks(rank: int, world: int) -> dict:
    """What torch's own users of the group do: a future's callback that waits for another all_reduce
    (torch's PowerSGD hook), functional collectives and the coalescing manager (called on the
    group's backend from C++), the deprecated work.result()."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    import sparcoll.torch
    pg = sparcoll_group(timeout=20)
    out = {}
    try:
        before = sparcoll.torch.stats(pg).collectives
        first = dist.all_reduce(torch.ones(100), group=pg, async_op=True).get_future()
        chained = first.then(lambda f: dist.all_reduce(torch.full((50,), float(rank + 1)), group=pg,
                                                       async_op=True).get_future().wait()[0])
        out["chained"] = chained.wait().tolist()[:3]
        out["on sparcoll"] = sparcoll.torch.stats(pg).collectives - before
        work = dist.all_reduce(torch.full((4,), 2.0), group=pg, async_op=True)
        work.wait()
        out["result"] = work.result()[0].tolist()
        out["gathered"] = funcol.all_gather_tensor(torch.full((2,), float(rank)), 0, pg).tolist()
        out["scattered"] = funcol.reduce_scatter_tensor(torch.arange(4.0), "sum", 0, pg).tolist()
        torch.manual_seed(0)
        model = DDP(nn_model(), process_group=pg)
        state = powersgd.PowerSGDState(process_group=pg, matrix_approximation_rank=1, start_powerSGD_iter=2)
        model.register_comm_hook(state, powersgd.powerSGD_hook)
        for step in range(4):
            model(torch.randn(8, 16, generator=torch.Generator().manual_seed(rank * 10 + step))).sum().backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(grads) for _ in range(world)]
        dist.all_gather(gathered, grads, group=pg)
        out["powersgd steps agree"] = all(torch.equal(g, grads) for g in gathered) and bool(grads.isfinite().all())
    finally:
        dist.destroy_process_group(pg)
    return out


def nn_model():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def test_collectives_torch_issues_from_callbacks_and_from_cpp_run_on_the_group():
    """Before: the callback's all_reduce waited for the thread that ran the callback (torch's PowerSGD
    hook hung DDP's backward for good), and the functional collectives raised "No backend type
    associated with device type cpu"."""
    for rank, out in enumerate(run_ranks(waits_inside_callbacks, WORLD, timeout=TIMEOUT)):
        assert out["chained"] == [3.0, 3.0, 3.0] and out["on sparcoll"] == 2, out
        assert out["result"] == [4.0] * 4 and out["gathered"] == [0.0, 0.0, 1.0, 1.0], out
        assert out["scattered"] == [2.0 * (2 * rank), 2.0 * (2 * rank + 1)], out
        assert out["powersgd steps agree"], out


def barrier_after_a_failure_on_one_rank(rank: int, world: int) -> dict:
    """Rank 0's communicator fails before the barrier (an input it refuses); rank 1's only learns of it
    in the barrier: the gloo part of the group must stay in step for both."""
    pg = sparcoll_group(timeout=20)
    out = {}
    try:
        if rank == 0:
            try:        # (the group's all_reduce hands such a tensor to gloo)
                pg.comm.allreduce(torch.ones(1).expand(8))
            except Exception as exc:        # refused on this rank: the communicator is failed
                out["refused"] = type(exc).__name__
        try:
            dist.barrier(group=pg)
            out["barrier"] = "passed"
        except Exception as exc:
            out["barrier"] = type(exc).__name__
        value = torch.full((1,), float(rank + 7))
        dist.broadcast(value, src=1, group=pg)
        out["broadcast"] = value.item()
    finally:
        dist.destroy_process_group(pg)
    return out


def test_a_barrier_after_a_failure_keeps_the_groups_gloo_part_in_step():
    """Before: the failed rank skipped the barrier's gloo part, and the group's next broadcast timed
    out on one rank and lost its connection on the other."""
    outs = run_ranks(barrier_after_a_failure_on_one_rank, WORLD, timeout=TIMEOUT)
    assert outs[0]["refused"] == "ValueError" and outs[0]["barrier"] == "PoisonedError", outs
    assert outs[1]["barrier"] != "passed", outs        # told of its peer's failure
    assert [out["broadcast"] for out in outs] == [8.0, 8.0], outs


def test_a_wait_that_reaches_the_deadline_gives_the_collective_up():
    """As sparcoll's own wait: a work waited for without a timeout that reaches its deadline poisons
    the communicator, so the collective never runs after that error (before, it could still write
    the caller's tensor a moment later). An explicit timeout is gloo's rule: the work goes on."""
    from sparcoll.engine import Work
    from sparcoll.errors import CollectiveTimeout
    from sparcoll.torch.backend import SparcollWork
    from sparcoll.torch.futures import Completion
    given_up = []
    late = Work(torch.ones(1), 7, time.monotonic() + 0.2, expired=given_up.append)
    with pytest.raises(CollectiveTimeout):
        SparcollWork(Completion([late.tensor], [late])).wait()
    assert len(given_up) == 1 and isinstance(given_up[0], CollectiveTimeout)
    patient = Work(torch.ones(1), 8, time.monotonic() + 60, expired=given_up.append)
    with pytest.raises(CollectiveTimeout):
        SparcollWork(Completion([patient.tensor], [patient])).wait(timedelta(seconds=0.1))
    assert len(given_up) == 1


def one_rank_int64_the_other_float32(rank: int, world: int) -> dict:
    """Rank 0 all_reduces float32 (sparcoll's), rank 1 int64 of the same size (gloo's), then both agree
    on an int64 all_reduce (both gloo's, beside sparcoll's small round) after a fresh group."""
    out = {}
    pg = sparcoll_group(timeout=30)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1000) if rank == 0 else torch.ones(1000, dtype=torch.int64), group=pg)
        out["error"] = None
    except Exception as exc:
        out["error"], out["text"] = type(exc).__name__, str(exc)
    out["elapsed"] = time.monotonic() - start
    dist.destroy_process_group(pg)
    pg = sparcoll_group(timeout=30)
    counts = torch.full((3,), rank + 1, dtype=torch.int64)
    dist.all_reduce(counts, group=pg)
    mixed = torch.full((2,), float(rank + 1))
    dist.all_reduce(mixed, op=dist.ReduceOp.MAX, group=pg)
    out["agreed"] = counts.tolist() + mixed.tolist()
    dist.destroy_process_group(pg)
    return out


def gloo_after_a_call_that_went_to_gloo_against_sparcoll(rank: int, world: int, async_op: bool) -> dict:
    """As one_rank_int64_the_other_float32 (rank 1's int64 call blocking or async), then a broadcast, an
    all_gather and a barrier on the same group: what each raised and how long it took."""
    pg = sparcoll_group(timeout=30)

    def all_reduce():
        work = dist.all_reduce(torch.ones(1000) if rank == 0 else torch.ones(1000, dtype=torch.int64), group=pg,
                               async_op=async_op and rank == 1)
        if work is not None:
            work.wait()
    out = {"all_reduce": outcome_of(all_reduce, expected=(Exception,))}
    out["broadcast"] = outcome_of(lambda: dist.broadcast(torch.ones(10), src=0, group=pg), expected=(Exception,))
    out["all_gather"] = outcome_of(lambda: dist.all_gather([torch.empty(3)] * world, torch.ones(3), group=pg),
                                   expected=(Exception,))
    out["barrier"] = outcome_of(lambda: dist.barrier(group=pg), expected=(Exception,))
    dist.destroy_process_group(pg)
    return out


def test_after_an_async_call_that_went_to_gloo_against_sparcoll_the_groups_gloo_collectives_fail_at_once():
    """Rank 1's int64 all_reduce went to gloo, rank 0's float32 one to sparcoll: both got MismatchError
    at once, but rank 1's gloo all_reduce stayed pending, and the group's next broadcast waited on both
    ranks for the group's timeout (a review; 30 minutes by default). An async call starts its gloo part
    before its check: the rank whose gloo part is out of step says so at once, and its peer's gloo
    collectives fail at once too."""
    outcomes = run_ranks(gloo_after_a_call_that_went_to_gloo_against_sparcoll, WORLD, timeout=TIMEOUT, async_op=True)
    for rank, out in enumerate(outcomes):
        assert out["all_reduce"][0] == "MismatchError", out
        for call in ("broadcast", "all_gather", "barrier"):
            kind, text, seconds = out[call]
            assert kind != "NO ERROR" and seconds < 10, (rank, call, out)
    for call in ("broadcast", "all_gather", "barrier"):
        assert outcomes[1][call][0] == "PoisonedError" and "gloo part is out of step" in outcomes[1][call][1], \
            outcomes[1]


def test_after_a_blocking_call_that_went_to_gloo_against_sparcoll_the_groups_gloo_part_still_works():
    """A blocking call checks before its gloo part starts: after the MismatchError no gloo call is
    pending, so the group's broadcast and all_gather still pair and work; what needs sparcoll (the
    barrier's round) says the communicator failed, at once."""
    outcomes = run_ranks(gloo_after_a_call_that_went_to_gloo_against_sparcoll, WORLD, timeout=TIMEOUT, async_op=False)
    for rank, out in enumerate(outcomes):
        assert out["all_reduce"][0] == "MismatchError", out
        assert out["broadcast"][0] == "NO ERROR" and out["all_gather"][0] == "NO ERROR", (rank, out)
        kind, text, seconds = out["barrier"]
        assert kind == "PoisonedError" and seconds < 10, (rank, out)


def calls_that_both_go_to_gloo_but_differ(rank: int, world: int) -> dict:
    """Rank 0 all_reduces int64 with MIN, rank 1 with MAX: both calls go to gloo, which mixes them
    silently; then the same group sums int64 (both gloo's) and float32 (sparcoll's); last, the ranks
    all_reduce int64 of 3 and 4 elements with MAX (after which gloo's pair may be closed)."""
    out = {}
    pg = sparcoll_group(timeout=30)
    op = dist.ReduceOp.MIN if rank == 0 else dist.ReduceOp.MAX
    out["ops"] = outcome_of(lambda: dist.all_reduce(torch.full((3,), rank + 1), op=op, group=pg))
    counts, values = torch.full((3,), rank + 1), torch.full((4,), float(rank + 1))
    dist.all_reduce(counts, group=pg)
    dist.all_reduce(values, group=pg)
    out["after"] = counts.tolist() + values.tolist()
    out["sizes"] = outcome_of(lambda: dist.all_reduce(torch.ones(3 + rank, dtype=torch.int64),
                                                      op=dist.ReduceOp.MAX, group=pg))
    # sizes for which gloo's own check ends the process that meets them first (a review: 3 against 5
    # and 1000 against 2000 int64, 3 against 5 float32 under MAX), and the group after them
    out["sizes gloo aborts on"] = [outcome_of(lambda: dist.all_reduce(
        torch.ones(n * (1 + rank), dtype=dtype), op=dist.ReduceOp.MAX, group=pg))[0]
        for n, dtype in ((3, torch.int64), (1000, torch.int64), (3, torch.float32))]
    counts = torch.full((3,), rank + 1)
    dist.all_reduce(counts, group=pg)
    out["after sizes"] = counts.tolist()
    dist.destroy_process_group(pg)
    return out


def test_ranks_whose_calls_both_go_to_gloo_but_differ_get_a_mismatch():
    """Before, rank 0 got the MIN of the two and rank 1 the MAX, with no error (as on a gloo group);
    with sizes 3 and 4, rank 0 got no error and rank 1 gloo's "Connection closed by peer"; with sizes
    3 and 6 one process ended in gloo ("Received data size doesn't match expected size"). Blocking
    calls check first: none reaches gloo, and the group's gloo part still works after them."""
    outcomes = run_ranks(calls_that_both_go_to_gloo_but_differ, WORLD, timeout=TIMEOUT)
    for rank, out in enumerate(outcomes):
        for case, named in (("ops", "MIN" if rank == 0 else "MAX"), ("sizes", f"{3 + rank} elements")):
            error, text, elapsed = out[case]
            assert error == "MismatchError" and elapsed < 10, (case, out)
            assert "different arguments" in text and named in text, (case, out)
        assert out["after"] == [3, 3, 3, 3.0, 3.0, 3.0, 3.0], out
        assert out["sizes gloo aborts on"] == ["MismatchError"] * 3 and out["after sizes"] == [3, 3, 3], out


def test_a_call_that_goes_to_gloo_against_one_that_goes_to_sparcoll_is_a_mismatch_at_once():
    """Before, each rank waited in its own library for the group's timeout (30 minutes by default)."""
    for out in run_ranks(one_rank_int64_the_other_float32, WORLD, timeout=TIMEOUT):
        assert out["error"] == "MismatchError" and out["elapsed"] < 10, out
        assert "check beside an all_reduce it hands to gloo" in out["text"], out     # not only tag 65534
        assert out["agreed"] == [3, 3, 3, 2.0, 2.0], out
