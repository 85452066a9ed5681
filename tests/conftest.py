"""Fixtures several test files share. Plain functions are elsewhere: support.py (waits, launches, test
data), ranks.py (ranks in processes of their own) and scenarios.py (what those ranks run), since code
that runs at import time or inside a child process cannot use fixtures. Imports are inside the
fixtures, so that a test file that uses none of them (test_netem.py, say) imports nothing more for
them."""
from __future__ import annotations

import os

import pytest


def pytest_configure(config):
    """Most tests exercise the sparse AllReduce itself, often with tensors small enough that the
    default algorithm ("auto") would send them through gloo's ring: the session runs with
    SPARCOLL_ALGORITHM=sparse (child processes run in the environment of the moment they are made;
    set here, not in a fixture, so that module-scoped fixtures see it too). Tests of the default as
    users get it (the choice itself, the README, the demo, DDP, training) are marked
    `auto_algorithm`."""
    os.environ["SPARCOLL_ALGORITHM"] = "sparse"


# The files that take the most CPU (their tests' CPU seconds, the machine's, in a run with -n 0: 157, 97,
# 67, 56, 52, 49, 40, 39, 35, 35, 35 of 824; the suite keeps both cores busy, so these are its time),
# most first: they start first, so that the last file to start is a short one (pytest-xdist, --dist
# loadfile: a file's tests stay on one worker, with its module fixtures; --no-loadscope-reorder, or
# xdist orders the files by their number of tests instead and the longest started last, adding about
# 40 s to a run). Only the order changes; the files not named run after these, as usual.
LONGEST_FIRST = ("test_multihost.py", "test_convergence.py", "test_parallel.py", "test_plan_execution.py",
                 "test_allreduce.py", "test_faults.py", "test_compression_hook.py", "test_readme.py",
                 "test_bench.py", "test_allocator.py", "test_simulate.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))    # stable: the rest keep their order


@pytest.fixture(autouse=True)
def default_algorithm_where_marked(request, monkeypatch):
    if request.node.get_closest_marker("auto_algorithm") is not None:
        monkeypatch.delenv("SPARCOLL_ALGORITHM", raising=False)


@pytest.fixture
def store():
    """A fresh in-process Store for Communicators run on threads."""
    import torch.distributed as dist

    return dist.HashStore()


@pytest.fixture(scope="module")
def dedicated_in_process():
    """One in-process dedicated aggregator without a secret, shared by a module's tests: its
    address list (the `aggregators` option)."""
    from sparcoll.server import AggregatorServer

    server = AggregatorServer("127.0.0.1", 0, b"")
    yield [server.address]
    server.close()


@pytest.fixture(scope="module")
def dedicated_processes():
    """Two `sparcoll aggregator` processes shared by a module's tests: their addresses."""
    from support import start_aggregator, stop

    procs = []
    try:
        for _ in range(2):
            procs.append(start_aggregator())
        yield [address for _, address in procs]
    finally:
        for proc, _ in procs:
            stop(proc)
