"""The process group of plain DDP on sparse gradients (sparcoll.train.serial_gloo): gloo with one
worker thread, on the devices gloo would take, summing sparse gradients as gloo does; and which jobs
of `sparcoll train` get it."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ranks import run_ranks
from sparcoll.train import serial_gloo
from sparcoll.train.worker import process_group_backend


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


class TwoTables(nn.Module):
    """Two sparse tables looked up with the same indices (as ncf's user tables are) and a dense layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Embedding(20, 4, sparse=True), nn.Embedding(20, 4, sparse=True)
        self.out = nn.Linear(8, 1)

    def forward(self, ids):
        return self.out(torch.cat([self.a(ids), self.b(ids)], 1)).sum()


def _one_thread_and_the_mean_gradient(rank, world):
    serial_gloo.register()
    before = _threads()
    gloo = dist.new_group(backend="gloo")
    with_gloo = _threads()
    serial = dist.new_group(backend=serial_gloo.NAME)
    with_serial = _threads()
    ids = torch.tensor([[1, 5, 5], [5, 7, 19]][rank])
    local = TwoTables()
    local(ids).backward()
    expected = {n: p.grad.to_dense() for n, p in local.named_parameters()}
    for grad in expected.values():            # DDP's mean, computed densely over the default group
        dist.all_reduce(grad)
        grad /= world
    model = TwoTables()
    ddp = DistributedDataParallel(model, process_group=serial)
    ddp(ids).backward()
    got = {n: p.grad.to_dense() for n, p in model.named_parameters()}
    sparse = [n for n, p in model.named_parameters() if p.grad.is_sparse]
    dist.destroy_process_group(serial)
    dist.destroy_process_group(gloo)
    return (with_gloo - before, with_serial - with_gloo, sparse,    # plain lists: the queue outlives the rank
            {n: g.tolist() for n, g in got.items()}, {n: g.tolist() for n, g in expected.items()})


def test_one_worker_thread_and_the_mean_of_sparse_gradients():
    for gloo_threads, serial_threads, sparse, got, expected in run_ranks(_one_thread_and_the_mean_gradient, 2):
        assert serial_threads == gloo_threads - 1        # gloo's two worker threads, one here
        assert sorted(sparse) == ["a.weight", "b.weight"]
        for name, grad in expected.items():
            assert torch.allclose(torch.tensor(got[name]), torch.tensor(grad), atol=1e-6), name


def _group_on(rank, world, interface):
    serial_gloo.register()
    os.environ["GLOO_SOCKET_IFNAME"] = interface        # after the default group: only this one reads it
    group = dist.new_group(backend=serial_gloo.NAME)
    t = torch.ones(3) * (rank + 1)
    dist.all_reduce(t, group=group)
    return t.tolist()


def test_the_devices_are_the_interfaces_of_gloo_socket_ifname():
    assert run_ranks(_group_on, 2, interface="lo") == [[3.0] * 3] * 2
    with pytest.raises(AssertionError, match="sparcoll-no-such-if"):
        run_ranks(_group_on, 2, interface="sparcoll-no-such-if")


def test_plain_ddp_on_sparse_gradients_gets_the_serial_group(tmp_path, monkeypatch):
    job = {"comm": "ddp", "options": {}}
    assert process_group_backend(job) == "gloo"
    assert process_group_backend({**job, "comm": "agsparse"}) == serial_gloo.NAME
    assert process_group_backend({**job, "options": {"sparse_embeddings": True}}) == serial_gloo.NAME
    # the hook sends sparse gradients through sparcoll, and mode sparcoll runs on sparcoll's backend
    assert process_group_backend({"comm": "hook", "options": {"sparse_embeddings": True}}) == "gloo"
    assert process_group_backend({"comm": "sparcoll", "options": {"sparse_embeddings": True}}) == "sparcoll"
    (tmp_path / "tables.py").write_text(
        "from torch import nn\n"
        "import torch\n"
        "def sparse():\n    return nn.EmbeddingBag(10, 4, sparse=True), torch.tensor([[1, 2]])\n"
        "def dense():\n    return nn.EmbeddingBag(10, 4), torch.tensor([[1, 2]])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert process_group_backend({**job, "model_spec": "tables:sparse"}) == serial_gloo.NAME
    assert process_group_backend({**job, "model_spec": "tables:dense"}) == "gloo"
