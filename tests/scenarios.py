"""Collectives run inside ranks in processes of their own (ranks.py). Every rank rebuilds every rank's
input from seeds, so each can compute the dense reference (and the expected traffic) independently of
sparcoll. The DDP cases at the end (test_torch_backend.py, test_hooks.py) compare DDP on a rank's slice
of each batch with a single-process model trained on the whole batch."""
from __future__ import annotations

import copy
import math
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}
HEADER = 56
INDEX = 4


def make_input(seed: int, rank: int, shape, dtype, density: float, block_size: int,
               transposed: bool = False) -> torch.Tensor:
    """Small integers (exact sums in any order and dtype) in a random set of non-zero blocks."""
    numel = math.prod(shape)
    nblocks = -(-numel // block_size)
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    values = torch.randint(1, 9, (nblocks, block_size), generator=g).double()
    values *= torch.randint(0, 2, (nblocks, block_size), generator=g).double() * 2 - 1
    values[torch.rand(nblocks, generator=g) >= density] = 0.0
    flat = values.view(-1)[:numel].to(dtype)
    if transposed:
        return flat.view(shape[1], shape[0]).t()
    return flat.view(shape).clone()


def reference(seed, world, shape, dtype, density, block_size, op, transposed=False):
    total = sum(make_input(seed, r, shape, torch.float64, density, block_size, transposed)
                for r in range(world))
    if op == "avg":
        total = total / world
    return total.to(dtype)


def correctness_cases(world: int) -> list[dict]:
    """Named cases: every dtype and op, awkward sizes, densities from 0 to 1."""
    cases = []
    shapes = [(0,), (1,), (255,), (256,), (1000,), (3, 333), (64, 1024), (1 << 18,)]
    for i, shape in enumerate(shapes):
        for dtype in DTYPES:
            for op in ("sum", "avg"):
                density = [0.0, 0.05, 0.5, 1.0][(i + len(cases)) % 4]
                cases.append(dict(name=f"w{world}-{'x'.join(map(str, shape))}-{dtype}-{op}-d{density}",
                                  shape=shape, dtype=dtype, op=op, density=density,
                                  transposed=len(shape) == 2 and shape[0] == 3,
                                  seed=len(cases)))
    return cases


def run_correctness(rank: int, world: int, cases: list[dict], block_size: int = 256,
                    async_batch: int = 4, **options) -> dict:
    """Run every case (some as async batches on one communicator); return name -> error or None."""
    import sparcoll

    outcome = {}
    with sparcoll.init(block_size=block_size, timeout=30, **options) as comm:
        pending = []
        for i, case in enumerate(cases):
            args = (case["seed"], case["shape"], DTYPES[case["dtype"]], case["density"], block_size)
            tensor = make_input(case["seed"], rank, case["shape"], DTYPES[case["dtype"]],
                                case["density"], block_size, case["transposed"])
            # Every third call blocks: queued behind async ones still pending, or run on this thread.
            work = comm.allreduce(tensor, op=case["op"], async_op=i % 3 != 2)
            pending.append((case, args, work))
            if len(pending) == async_batch or case is cases[-1]:
                for case_, args_, work_ in pending:
                    seed, shape, dtype, density, bs = args_
                    expected = reference(seed, world, shape, dtype, density, bs, case_["op"],
                                         case_["transposed"])
                    got = work_.wait(timeout=60) if hasattr(work_, "wait") else work_
                    ok = got.shape == expected.shape and got.dtype == expected.dtype and \
                        torch.equal(got, expected)
                    outcome[case_["name"]] = None if ok else (
                        f"max abs error {(got.double() - expected.double()).abs().max():g}")
                pending = []
        outcome["stats"] = comm.stats
    return outcome


def check_outcome(outcomes: list[dict], cases: list[dict]) -> None:
    """Every rank's run_correctness outcome of every case is None (its sum was the reference's)."""
    failures = {}
    for rank, outcome in enumerate(outcomes):
        for case in cases:
            if outcome.get(case["name"], "missing") is not None:
                failures[f"rank {rank} {case['name']}"] = outcome.get(case["name"], "missing")
    assert not failures, failures


def run_layouts(rank: int, world: int, layouts: dict, nblocks: int, block_size: int = 256) -> dict:
    """Each layout (name -> the non-zero block indices, the same on every rank) summed with the
    sparse path forced; name -> (whether it equals the float64 reference, how many messages to or
    from a remote aggregator went from or into the tensor's memory in several runs, how many went
    through one buffer)."""
    from unittest import mock

    import sparcoll
    from sparcoll import worker

    counts = {"in place": 0, "buffered": 0}

    def counted_runs(indices, limit):
        spans = worker_runs(indices, limit)
        if spans is None:
            counts["buffered"] += 1
        elif len(spans) > 1:
            counts["in place"] += 1
        return spans

    worker_runs = worker.runs
    out = {}
    with mock.patch.object(worker, "runs", counted_runs), \
            sparcoll.init(block_size=block_size, timeout=30, algorithm="sparse") as comm:
        for name, blocks in layouts.items():
            inputs = []
            for r in range(world):
                g = torch.Generator().manual_seed(r)
                rows = torch.zeros(nblocks, block_size, dtype=torch.float64)
                rows[blocks] = torch.randint(1, 9, (len(blocks), block_size), generator=g).double()
                inputs.append(rows.view(-1))
            tensor = inputs[rank].float()
            counts.update({"in place": 0, "buffered": 0})
            comm.allreduce(tensor)
            out[name] = (torch.equal(tensor, sum(inputs).float()), counts["in place"],
                         counts["buffered"])
    return out


def run_float_sums(rank: int, world: int, numel: int, **options) -> float:
    """Random normal float32 (inexact sums): the error against a float64 reference, in units of
    float32 epsilon times the sum of magnitudes (float summation's own error bound is world - 1)."""
    import sparcoll

    def make(r):
        return torch.randn(numel, generator=torch.Generator().manual_seed(r))

    with sparcoll.init(timeout=30, **options) as comm:
        x = make(rank)
        comm.allreduce(x)
    ref = sum(make(r).double() for r in range(world))
    magnitude = sum(make(r).double().abs() for r in range(world))
    return float(((x.double() - ref).abs() / magnitude).max() / torch.finfo(torch.float32).eps)


def run_overwrite_after_return(rank: int, world: int, rounds: int, numel: int) -> list:
    """Rank 0 scribbles over its tensor the moment allreduce returns, as a training step reusing its
    gradient buffer would. Its own aggregator sums its shard in that tensor and sends the peers
    their results from there, so returning before those sends finished would hand the peers
    garbage. Rank 0's sends of results are slowed down, so that window is wide open. Returns, per
    round, whether this rank's result was exact (rank 0: not checked)."""
    import sparcoll
    from sparcoll import transport, wire

    if rank == 0:
        original = transport.sendmsg_all

        def slow_results(sock, views, *flags):
            if views[0][5] == wire.Kind.RESULT:
                time.sleep(0.02)
            return original(sock, views, *flags)
        transport.sendmsg_all = slow_results
    exact = []
    with sparcoll.init(timeout=30) as comm:
        x = torch.empty(numel)
        for i in range(rounds):
            inputs = [make_input(500 + i, r, (numel,), torch.float32, 1.0, 256)
                      for r in range(world)]
            x.copy_(inputs[rank])
            comm.allreduce(x)
            if rank == 0:
                x.fill_(float("nan"))
            else:
                exact.append(torch.equal(x, sum(inputs)))
    return exact


def run_special_values(rank: int, world: int) -> dict:
    """NaN and Inf propagate like a dense sum; blocks of -0.0 count as zero and are not sent."""
    import sparcoll
    import torch.distributed as dist

    with sparcoll.init(timeout=30) as comm:
        x = torch.zeros(4096)
        if rank == 0:
            x[5] = float("nan")
            x[3000] = 1.0
        else:
            x[300] = float("inf")
            x[3001] = -2.0
        expected = torch.zeros(4096)
        expected[5], expected[300], expected[3000], expected[3001] = float("nan"), float("inf"), 1, -2
        comm.allreduce(x)
        special = torch.equal(torch.nan_to_num(x, nan=7.0), torch.nan_to_num(expected, nan=7.0))
        dist.barrier()      # every rank holds all results: every block of that collective is counted
        before = comm.stats.blocks_sent + comm.aggregator_stats.blocks_sent
        comm.allreduce(torch.full((8192,), -0.0))
        dist.barrier()
        after = comm.stats.blocks_sent + comm.aggregator_stats.blocks_sent
        dist.barrier()      # no rank closes (a BYE message) before every rank has read
    return {"special": special, "negative_zero_blocks_sent": after - before}


def run_byte_accounting(rank: int, world: int, densities, numel: int, message_blocks: int) -> list:
    """For one collective per density: this rank's measured traffic next to the formula's."""
    import sparcoll
    import torch.distributed as dist
    from sparcoll.protocol import Geometry

    block_size, itemsize = 256, 4
    block_bytes = block_size * itemsize
    report = []
    with sparcoll.init(block_size=block_size, message_blocks=message_blocks, timeout=30) as comm:
        for i, density in enumerate(densities):
            inputs = [make_input(100 + i, r, (numel,), torch.float32, density, block_size)
                      for r in range(world)]
            nonzero = [set(x.view(-1, block_size).ne(0).any(1).nonzero().squeeze(1).tolist())
                       for x in inputs]
            union = set().union(*nonzero)
            geometry = Geometry(numel // block_size, world, 1)
            expected_sent = expected_union = remote_blocks = 0
            agg_in = agg_out_union = 0
            for agg, _, lo, hi in geometry.ranges():
                mine = sum(lo <= b < hi for b in nonzero[rank])
                union_here = sum(lo <= b < hi for b in union)
                if agg != rank:
                    messages = max(1, math.ceil(mine / message_blocks))
                    remote_blocks += mine
                    expected_sent += mine * (block_bytes + INDEX) + messages * HEADER
                    expected_union += union_here * (block_bytes + INDEX)
                else:
                    for w in range(world):
                        if w != rank:
                            theirs = sum(lo <= b < hi for b in nonzero[w])
                            agg_in += theirs * (block_bytes + INDEX) + \
                                max(1, math.ceil(theirs / message_blocks)) * HEADER
                    agg_out_union = union_here * (block_bytes + INDEX) * (world - 1)
            s0, a0 = comm.stats, comm.aggregator_stats
            dist.barrier()      # every rank has read its counters before any traffic starts
            x = inputs[rank].clone()
            comm.allreduce(x)
            dist.barrier()      # every rank has all its results, so every byte is counted
            s1, a1 = comm.stats, comm.aggregator_stats
            dist.barrier()      # no rank closes (a BYE message) before every rank has read
            assert torch.equal(x, sum(inputs)), "wrong sum"
            report.append(dict(
                density=density, remote_blocks=remote_blocks,
                sent=s1.bytes_sent - s0.bytes_sent, expected_sent=expected_sent,
                received_data=(s1.bytes_received - s0.bytes_received)
                - HEADER * (s1.messages_received - s0.messages_received),
                expected_received_data=expected_union,
                agg_received=a1.bytes_received - a0.bytes_received, expected_agg_received=agg_in,
                agg_sent_data=(a1.bytes_sent - a0.bytes_sent)
                - HEADER * (a1.messages_sent - a0.messages_sent),
                expected_agg_sent_data=agg_out_union,
                messages_sent=s1.messages_sent - s0.messages_sent,
                messages_received=s1.messages_received - s0.messages_received,
                bytes_received=s1.bytes_received - s0.bytes_received))
    return report


def _expect_error(fn, types, timeout):
    start = time.monotonic()
    try:
        fn()
    except types as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    except Exception as exc:   # the wrong kind of error is reported, not swallowed
        return f"UNEXPECTED {type(exc).__name__}", str(exc), time.monotonic() - start
    return "NO ERROR", "", time.monotonic() - start


def run_bad_inputs(rank: int, world: int) -> dict:
    """Each case on a fresh communicator (a failed collective poisons its communicator)."""
    import sparcoll

    good = torch.ones(1000)
    cases = {
        "int64_on_rank0": lambda: torch.ones(1000, dtype=torch.int64) if rank == 0 else good.clone(),
        "complex_everywhere": lambda: torch.ones(10, dtype=torch.complex64),
        "bool_everywhere": lambda: torch.ones(10, dtype=torch.bool),
        "numel_mismatch": lambda: torch.ones(1000 + 300 * rank),
        "dtype_mismatch": lambda: torch.ones(1000, dtype=torch.float64 if rank else torch.float32),
        "meta_device_on_rank1": lambda: torch.empty(1000, device="meta") if rank == 1 else good.clone(),
        "sparse_on_rank0": lambda: torch.ones(1000).to_sparse() if rank == 0 else good.clone(),
    }
    outcome = {}
    for name, make in cases.items():
        with sparcoll.init(timeout=20) as comm:
            outcome[name] = _expect_error(lambda: comm.allreduce(make()),
                                          (sparcoll.SparcollError, TypeError, ValueError), 20)
            outcome[name + "/then"] = _expect_error(lambda: comm.allreduce(good.clone()),
                                                    (sparcoll.SparcollError,), 20)
    with sparcoll.init(timeout=20) as comm:
        op = "max" if rank == 0 else "sum"
        outcome["op_max_on_rank0"] = _expect_error(lambda: comm.allreduce(good.clone(), op=op),
                                                   (sparcoll.SparcollError, ValueError), 20)
    return outcome


def run_interrupted(rank: int, world: int) -> dict:
    """Rank 0's blocking allreduce (run on its own thread) is interrupted by Ctrl-C while rank 1
    has not called it yet: rank 0 sees the KeyboardInterrupt, its communicator is poisoned, and
    rank 1 is told at once instead of waiting out its timeout."""
    import signal

    import sparcoll

    def interrupt(signum, frame):
        raise KeyboardInterrupt
    outcome = {}
    store = dist.distributed_c10d._get_default_store()
    with sparcoll.init(timeout=20) as comm:
        comm.allreduce(torch.ones(1000))     # both ranks up and connected
        if rank == 0:
            signal.signal(signal.SIGALRM, interrupt)
            signal.setitimer(signal.ITIMER_REAL, 0.5)
            start = time.monotonic()
            try:
                comm.allreduce(torch.ones(1 << 16))
                outcome["interrupted"] = ("NO ERROR", "", time.monotonic() - start)
            except KeyboardInterrupt:
                outcome["interrupted"] = ("KeyboardInterrupt", "", time.monotonic() - start)
            finally:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                store.set("interrupted/0", "1")
            # Stay in the job until rank 1 has its answer: it must come from the interruption,
            # not from this rank leaving.
            store.wait(["interrupted/1"], timedelta(seconds=30))
        else:
            store.wait(["interrupted/0"], timedelta(seconds=30))   # call only after rank 0's is over
            outcome["interrupted"] = _expect_error(lambda: comm.allreduce(torch.ones(1 << 16)),
                                                   (sparcoll.SparcollError,), 20)
            store.set("interrupted/1", "1")
        outcome["then"] = _expect_error(lambda: comm.allreduce(torch.ones(10)),
                                        (sparcoll.SparcollError,), 20)
    return outcome


def run_blocking_call_in_done_callback(rank: int, world: int) -> dict:
    """A done-callback (it runs on the engine thread) makes a blocking allreduce while another
    collective is still queued: the engine thread serves the queue in order instead of waiting for
    itself. Rank 1 starts only once rank 0 has added its callback, so rank 0's first collective
    cannot have finished by then and its callback surely runs on its engine thread."""
    import threading

    import sparcoll

    outcome = {}
    store = dist.distributed_c10d._get_default_store()
    with sparcoll.init(timeout=20) as comm:
        if rank == 1:
            store.wait(["callback-added/0"], timedelta(seconds=30))
        first = comm.allreduce(torch.ones(100_000), async_op=True)
        second = comm.allreduce(torch.full((3000,), 2.0), async_op=True)

        def callback(work):
            outcome["thread"] = threading.current_thread().name
            outcome["inner"] = float(comm.allreduce(torch.full((5000,), float(rank + 1))).max())
        first.add_done_callback(callback)
        if rank == 0:
            store.set("callback-added/0", "1")
        outcome["first"] = float(first.wait(30).min())
        outcome["second"] = float(second.wait(30).min())
        deadline = time.monotonic() + 30
        while "inner" not in outcome and time.monotonic() < deadline:
            time.sleep(0.01)
    return outcome


def make_coo(seed: int, rank: int, shape, entries: int, dtype=torch.float32) -> torch.Tensor:
    """An uncoalesced row-sparse COO tensor (repeated rows, as embedding gradients have)."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    rows = torch.randint(0, shape[0], (1, entries), generator=g)
    values = torch.randint(-4, 5, (entries, *shape[1:]), generator=g).to(dtype)
    return torch.sparse_coo_tensor(rows, values, shape, check_invariants=True)


def run_coo(rank: int, world: int, cases) -> dict:
    """allreduce_coo against the dense sum of every rank's COO input, and its traffic."""
    import sparcoll

    outcome = {}
    with sparcoll.init(timeout=30) as comm:
        for name, shape, entries, op in cases:
            inputs = [make_coo(len(outcome), r, shape, entries) for r in range(world)]
            expected = sum(x.to_dense().double() for x in inputs)
            if op == "avg":
                expected = expected / world
            before = comm.stats.blocks_sent
            got = comm.allreduce_coo(inputs[rank], op=op)
            touched = int(inputs[rank].coalesce().indices().numel())   # rows stored here
            stored = sum(inputs[1:], inputs[0]).coalesce()     # the rows some rank stored, as gloo's sum lists them
            holding = stored.indices()[0][stored.values().reshape(stored._nnz(), math.prod(shape[1:])).ne(0).any(dim=1)]
            listed = set(got.coalesce().indices()[0].tolist())
            outcome[name] = dict(
                layout=str(got.layout), shape=tuple(got.shape),
                exact=torch.equal(got.to_dense(), expected.float()),
                rows_nobody_stored=len(listed - set(stored.indices()[0].tolist())),
                rows_missing=len(set(holding.tolist()) - listed),
                blocks_sent=comm.stats.blocks_sent - before,
                max_blocks=touched * (-(-math.prod(shape[1:]) // 256) + 1))
    return outcome


# ---- DDP cases: a model, its global batches and DDP options ------------------------------------
DDP_STEPS = 4
DDP_ROWS = 6          # per rank and step
DDP_TOLERANCE = 1e-5


class Embedded(nn.Module):
    """Embedding + linear; with a dense embedding most 256-element gradient blocks are zero."""

    def __init__(self, sparse: bool):
        super().__init__()
        self.embedding = nn.Embedding(600, 8, sparse=sparse)
        self.out = nn.Linear(8, 1)

    def forward(self, ids):
        return self.out(self.embedding(ids).sum(1)).squeeze(1)


class WithUnused(nn.Module):
    """A branch that takes no part in the loss: DDP needs find_unused_parameters=True."""

    def __init__(self):
        super().__init__()
        self.used = nn.Linear(8, 1)
        self.unused = nn.Linear(8, 3)

    def forward(self, x):
        return self.used(x).squeeze(1)


def mlp():
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1),
                         nn.Flatten(0))


def dense_inputs(g, n):
    return torch.randn(n, 8, generator=g)


def id_inputs(g, n):
    return torch.randint(0, 600, (n, 3), generator=g)


DDP_CASES = {   # name: (model factory, input factory, DDP options)
    "dense-mlp": (mlp, dense_inputs, {}),
    "dense-embedding": (lambda: Embedded(sparse=False), id_inputs, {}),
    "sparse-embedding": (lambda: Embedded(sparse=True), id_inputs, {}),
    "many-buckets": (mlp, dense_inputs, {"bucket_cap_mb": 0.002}),
    "unused-parameters": (WithUnused, dense_inputs, {"find_unused_parameters": True}),
    "bucket-views": (mlp, dense_inputs, {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.002}),
    "static-graph": (lambda: Embedded(sparse=False), id_inputs, {"static_graph": True}),
    "static-graph-unused": (WithUnused, dense_inputs, {"static_graph": True}),
}


def global_batch(case: str, step: int, world: int):
    g = torch.Generator().manual_seed(1000 + step)
    inputs = DDP_CASES[case][1](g, DDP_ROWS * world)
    return inputs, torch.randn(DDP_ROWS * world, generator=g)


def ddp_error_vs_reference(rank: int, world: int, case: str, wrap) -> float:
    """Train `case` for DDP_STEPS steps with DDP (made by wrap(model, ddp_options)) on this rank's
    slice of each global batch, and a single-process copy on the whole batch; the largest parameter
    difference seen after any step, relative to the parameter's scale (at least 1)."""
    make_model, _, options = DDP_CASES[case]
    torch.manual_seed(0)
    model = make_model()
    reference = copy.deepcopy(model)
    ddp = wrap(model, options)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference)]
    rows = slice(rank * DDP_ROWS, (rank + 1) * DDP_ROWS)
    worst = 0.0
    for step in range(DDP_STEPS):
        inputs, targets = global_batch(case, step, world)
        for net, x, y, opt in ((ddp, inputs[rows], targets[rows], optimizers[0]),
                               (reference, inputs, targets, optimizers[1])):
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        worst = max(worst, max(((a - b).abs().max() / b.abs().max().clamp(min=1)).item()
                               for a, b in zip(model.parameters(), reference.parameters())))
    return worst


def all_cases_vs_reference(rank: int, world: int, wrap) -> dict:
    return {case: ddp_error_vs_reference(rank, world, case, wrap) for case in DDP_CASES}


def assert_all_match(outcomes: list[dict]) -> None:
    """(In the test's process) every rank ran every DDP case within DDP_TOLERANCE of its reference."""
    for rank, errors in enumerate(outcomes):
        assert set(errors) == set(DDP_CASES)
        for case, error in errors.items():
            assert error < DDP_TOLERANCE, (rank, case, error)


def half_precision_vs_float64(rank: int, world: int, dtype_name: str, wrap) -> dict:
    """One backward of a bfloat16 or float16 model under DDP (made by wrap(model)) against the mean
    over ranks of each rank's gradient computed in float64 on a copy (gathered on the default group,
    gloo's): the averaged gradients' largest error relative to that mean, and the rank's own
    gradient's (far larger: a missing rank shows)."""
    torch.manual_seed(0)
    model = mlp().to(getattr(torch, dtype_name))
    reference = copy.deepcopy(model).double()
    ddp = wrap(model)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank)) * (1 + 2 * rank)  # ranks apart
    ddp(x.to(model[0].weight.dtype)).float().square().sum().backward()
    reference(x.double()).square().sum().backward()
    local = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    expected = torch.stack(gathered).mean(0)
    got = torch.cat([p.grad.reshape(-1).double() for p in model.parameters()])
    scale = expected.abs().max()
    return {"error": ((got - expected).abs().max() / scale).item(),
            "own_error": ((local - expected).abs().max() / scale).item()}


def assert_half_precision_mean(outcome: dict) -> None:
    """Within 3% of the float64 mean (bf16 rounding of the model's own computation is about 0.3%),
    and a rank's own gradient more than 20% from it."""
    assert outcome["error"] < 0.03, outcome
    assert outcome["own_error"] > 0.2, outcome
