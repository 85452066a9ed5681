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


# The files that take longest (their tests' seconds in a whole run, `--durations=0`: 107, 53, 53, 43,
# 38, 36, 36, 33, 30, 25 of 643), longest first: they start first, so that with two workers
# (pytest-xdist, --dist loadfile: a file's tests stay on one worker, with its module fixtures) the last
# file to start is a short one. Only the order changes; the files not named run after these, as usual.
LONGEST_FIRST = ("test_multihost.py", "test_convergence.py", "test_plan_execution.py", "test_parallel.py",
                 "test_faults.py", "test_allreduce.py", "test_readme.py", "test_compression_hook.py",
                 "test_bench.py", "test_algorithm.py")


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
