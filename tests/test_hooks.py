"""sparcoll.torch.allreduce_hook: never blocks, completes from the communicator's callback, fails its
future on errors; under DDP on 2 gloo ranks it matches a single-process full-batch reference, and a
bfloat16 or float16 model's buckets come back as the float64 mean of the ranks' gradients."""
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import pytest

import sparcoll
import sparcoll.torch
from ranks import run_ranks
from scenarios import (all_cases_vs_reference, assert_all_match, assert_half_precision_mean,
                       half_precision_vs_float64, mlp)

pytestmark = pytest.mark.auto_algorithm   # as users get it (conftest.py)

TIMEOUT = 90
WORLD = 2


class FakeBucket:
    def __init__(self, buffer):
        self._buffer = buffer

    def buffer(self):
        return self._buffer


class FakeComm:
    """Records calls; each allreduce returns a torch Future the test completes (or raises)."""

    def __init__(self, error=None):
        self.calls, self.futures, self.error = [], [], error

    def allreduce(self, tensor, op="sum", async_op=False):
        self.calls.append((tensor, op, async_op))
        if self.error is not None:
            raise self.error
        self.futures.append(torch.futures.Future())
        return self.futures[-1]


def test_hook_starts_the_average_and_returns_without_waiting():
    comm, buffer = FakeComm(), torch.ones(4)
    future = sparcoll.torch.allreduce_hook(sparcoll.torch.HookState(comm), FakeBucket(buffer))
    assert comm.calls == [(buffer, "avg", True)]
    assert not future.done()
    comm.futures[0].set_result(buffer)
    assert future.done() and future.value() is buffer


def test_failed_allreduce_fails_the_future():
    comm = FakeComm()
    future = sparcoll.torch.allreduce_hook(sparcoll.torch.HookState(comm), FakeBucket(torch.ones(4)))
    comm.futures[0].set_exception(sparcoll.PeerError("aggregator 1 went away"))
    with pytest.raises(RuntimeError, match="aggregator 1 went away"):
        future.wait()


def test_allreduce_raising_at_call_fails_the_future_instead():
    comm = FakeComm(error=sparcoll.PoisonedError("an earlier collective failed"))
    future = sparcoll.torch.allreduce_hook(sparcoll.torch.HookState(comm), FakeBucket(torch.ones(4)))
    with pytest.raises(RuntimeError, match="an earlier collective failed"):
        future.wait()


def ddp_with_hook(rank: int, world: int) -> dict:
    state = sparcoll.torch.HookState(sparcoll.init())

    def wrap(model, options):
        ddp = DDP(model, **options)
        ddp.register_comm_hook(state, sparcoll.torch.allreduce_hook)
        return ddp

    try:
        return all_cases_vs_reference(rank, world, wrap)
    finally:
        state.comm.close()


def hook_backward_fails(rank: int, world: int) -> str:
    """Rank 0 runs backward through the hook while rank 1 allreduces another size."""
    comm = sparcoll.init()
    torch.manual_seed(0)
    model = DDP(mlp())
    model.register_comm_hook(sparcoll.torch.HookState(comm), sparcoll.torch.allreduce_hook)
    try:
        if rank == 0:
            model(torch.randn(4, 8)).sum().backward()
        else:
            comm.allreduce(torch.ones(5))
        return "no error"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        comm.close()


def test_ddp_with_hook_matches_full_batch_reference():
    assert_all_match(run_ranks(ddp_with_hook, WORLD, timeout=TIMEOUT))


def test_failed_allreduce_in_ddp_backward_raises_runtime_error():
    rank0, rank1 = run_ranks(hook_backward_fails, WORLD, timeout=TIMEOUT)
    assert rank0.startswith("RuntimeError") and "MismatchError" in rank0, rank0
    assert rank1.startswith("MismatchError"), rank1


def half_precision_gradients(rank: int, world: int, dtype_name: str) -> dict:
    """A half-precision model under DDP with the hook, against the float64 mean (scenarios.py); and
    the dtypes of the buckets the hook saw."""
    state = sparcoll.torch.HookState(sparcoll.init())
    seen = []

    def hook(state, bucket):
        seen.append(bucket.buffer().dtype)
        return sparcoll.torch.allreduce_hook(state, bucket)

    def wrap(model):
        ddp = DDP(model)
        ddp.register_comm_hook(state, hook)
        return ddp
    try:
        errors = half_precision_vs_float64(rank, world, dtype_name, wrap)
        return {**errors, "dtypes": sorted({str(d) for d in seen})}
    finally:
        state.comm.close()


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_half_precision_buckets_average_to_the_float64_mean(dtype_name):
    """DDP's buckets of a bfloat16 or float16 model go through the hook in their own dtype and come
    back as the ranks' mean, within the half type's rounding of the model's own computation (a rank's
    own gradient is much farther from the mean: the check can tell a missing rank)."""
    for outcome in run_ranks(half_precision_gradients, WORLD, timeout=TIMEOUT, dtype_name=dtype_name):
        assert outcome["dtypes"] == [f"torch.{dtype_name}"]
        assert_half_precision_mean(outcome)
