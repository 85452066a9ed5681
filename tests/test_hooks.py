"""sparcoll.torch.allreduce_hook: never blocks, completes from the communicator's callback, fails its
future on errors; under DDP on 2 gloo ranks it matches a single-process full-batch reference."""
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import pytest

import sparcoll
import sparcoll.torch
from ranks import run_ranks
from scenarios import all_cases_vs_reference, assert_all_match, mlp

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
