"""Fixtures several test files share. Plain functions are elsewhere: support.py (waits, launches, test
data), ranks.py (spawned ranks) and scenarios.py (what those ranks run), since code that runs at import
time or inside a child process cannot use fixtures. Imports are inside the fixtures, so that a test file
that uses none of them (test_netem.py, say) imports nothing more for them."""
from __future__ import annotations

import pytest


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
