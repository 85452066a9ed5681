"""DataParallel's embeddings declared with dense gradients whose weight takes the sparse AllReduce
(sparse.Lookups): their rows are looked up sparse, so the weight's gradient reaches the wrapper as
COO rows (no scan of the dense table), and comes back dense, equal to the average an independent
float64 computation over every rank's batch gives. Where something else adds to the weight's
gradient (a regularizer), or gradients accumulate under no_sync, or a rank skips the table
(find_unused_parameters), the result is still that average; a table under another strategy is left
alone. 2 gloo processes."""
import torch
import torch.distributed as dist
from torch import nn

import sparcoll
import sparcoll.torch
from ranks import run_ranks

WORLD = 2
ROWS = 300


class Tables(nn.Module):
    """Two dense-gradient tables (an Embedding, a sum EmbeddingBag), a max EmbeddingBag (no sparse
    gradient in torch) and a head; `uses_table` False skips the Embedding (a branch)."""

    def __init__(self, regularize: float = 0.0):
        super().__init__()
        torch.manual_seed(3)
        self.table = nn.Embedding(ROWS, 8)
        self.bag = nn.EmbeddingBag(ROWS, 8, mode="sum")
        self.maxbag = nn.EmbeddingBag(ROWS, 8, mode="max")
        self.head = nn.Linear(8, 1)
        self.regularize = regularize

    def forward(self, ids, uses_table: bool = True):
        bags = self.bag(ids) + self.maxbag(ids)
        hidden = self.table(ids).sum(1) + bags if uses_table else bags
        out = self.head(hidden).squeeze(1)
        if self.regularize:
            out = out + self.regularize * self.table.weight.pow(2).sum()
        return out


def ids_of(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(ROWS, (4, 3), generator=g)


def loss_of(model, rank: int, step: int, uses_table: bool = True) -> torch.Tensor:
    return model(ids_of(rank, step), uses_table).pow(2).mean()


def reference(steps: list[int], world: int, regularize: float = 0.0, skipping: int | None = None) -> list:
    """The gradient of the mean over ranks of the losses of `steps` (accumulated), on one float64
    copy; rank `skipping` leaves the table out."""
    model = Tables(regularize).double()
    total = sum(loss_of(model, r, s, r != skipping) for r in range(world) for s in steps)
    (total / world).backward()
    return [p.grad.float() for p in model.parameters()]


def run(wrapped, model, rank: int, steps: list[int], uses_table: bool = True) -> list:
    """Gradients after the steps' losses, the first ones under no_sync; each gradient's layout as it
    reached the wrapper (a hook registered before the wrapper's runs first)."""
    for p in model.parameters():
        p.grad = None
    for s in steps[:-1]:
        with wrapped.no_sync():
            loss_of(wrapped, rank, s, uses_table).backward()
    loss_of(wrapped, rank, steps[-1], uses_table).backward()
    return [p.grad.clone() for p in model.parameters()]


def lookups(rank: int, world: int) -> dict:
    comm = sparcoll.init()
    out = {}
    sparse_tables = {"table.weight": "sparse", "bag.weight": "sparse", "maxbag.weight": "sparse",
                     "head.weight": "ring", "head.bias": "ring"}
    cases = {"plain": (0.0, sparse_tables, [0]), "regularized": (1e-3, sparse_tables, [1]),
             "accumulated": (0.0, sparse_tables, [2, 3]), "table on the ring": (0.0, "ring", [4])}
    for name, (regularize, strategy, steps) in cases.items():
        model = Tables(regularize)
        came_sparse = {}

        def note(q, n):
            came_sparse.setdefault(n, q.grad.is_sparse)
        for pname, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda q, n=pname: note(q, n))
        wrapped = sparcoll.torch.DataParallel(model, comm=comm, strategy=strategy)
        grads = run(wrapped, model, rank, steps)
        want = reference(steps, world, regularize)
        out[name] = {"error": max(((g - w).norm() / w.norm()).item() for g, w in zip(grads, want)),
                     "dense": all(not g.is_sparse for g in grads), "came sparse": came_sparse,
                     "left dense": not model.table.sparse}
        wrapped.close()
    # steps in a row: the table kept from step to step holds each step's rows alone, also after the
    # caller changed it in place everywhere (a noise added, as differential privacy does) or zeroed it
    # in place (zero_grad(set_to_none=False): the next gradient then comes dense)
    model = Tables()
    wrapped = sparcoll.torch.DataParallel(model, comm=comm, strategy=sparse_tables)
    errors, tables = [], []
    for s, between in ((6, None), (7, "noise"), (8, "zeroed"), (9, None)):
        if between == "noise":
            model.table.weight.grad.add_(1.0)
        if between == "zeroed":
            for p in model.parameters():
                p.grad.zero_()
            loss_of(wrapped, rank, s).backward()
            grads = [p.grad.clone() for p in model.parameters()]
        else:
            grads = run(wrapped, model, rank, [s])
        tables.append(model.table.weight.grad.data_ptr())
        want = reference([s], world)
        errors.append(max(((g - w).norm() / w.norm()).item() for g, w in zip(grads, want)))
    out["steps in a row"] = {"errors": errors, "one table": tables[0] == tables[1] == tables[3]}
    wrapped.close()
    model = Tables()
    wrapped = sparcoll.torch.DataParallel(model, comm=comm, strategy=sparse_tables, find_unused_parameters=True)
    grads = run(wrapped, model, rank, [5], uses_table=rank != 1)
    want = reference([5], world, skipping=1)
    out["skipped by rank 1"] = max(((g - w).norm() / w.norm()).item() for g, w in zip(grads, want))
    wrapped.close()
    comm.close()
    dist.barrier()
    return out


def test_dense_declared_tables_under_the_sparse_allreduce_go_as_rows_and_come_back_dense():
    for out in run_ranks(lookups, WORLD, timeout=120):
        for case in ("plain", "regularized", "accumulated", "table on the ring"):
            assert out[case]["error"] <= 1e-5, (case, out[case])
            assert out[case]["dense"] and out[case]["left dense"], (case, out[case])
        # looked up sparse where the sparse AllReduce takes the table, and only there
        assert out["plain"]["came sparse"] == {"table.weight": True, "bag.weight": True, "maxbag.weight": False,
                                               "head.weight": False, "head.bias": False}
        # a regularizer adds a dense part: autograd sums the weight's gradient dense, and it goes dense
        assert out["regularized"]["came sparse"]["table.weight"] is False
        assert out["regularized"]["came sparse"]["bag.weight"] is True
        assert out["accumulated"]["came sparse"]["table.weight"] is True
        assert not any(out["table on the ring"]["came sparse"].values())
        assert out["skipped by rank 1"] <= 1e-5, out
        assert max(out["steps in a row"]["errors"]) <= 1e-5 and out["steps in a row"]["one table"], out


def profiled(rank: int, world: int) -> dict:
    """profile_sparse_own times a dense-declared table's gradient as DataParallel sends it (its rows as
    COO, the sum made dense), another large dense gradient as it is; spared_by_lookups measures what
    looking the model's tables up sparse spares its backward."""
    from sparcoll.plan.profiler import lookup_names, profile_sparse_own, spared_by_lookups, together_timeline

    comm = sparcoll.init()
    calls = {"allreduce": 0, "allreduce_coo": 0}
    for name in calls:
        def counted(*args, _call=getattr(comm, name), _name=name, **kwargs):
            calls[_name] += 1
            return _call(*args, **kwargs)
        setattr(comm, name, counted)
    table = torch.zeros(4096, 16)
    table[torch.arange(rank, 4096, 97)] = 1.0
    other = table.clone().reshape(-1)
    tensors = {"table.weight": {"union": 0.02}, "other": {"union": 0.02}}
    out = {}
    for name, gradient, lookups in (("table.weight", table, {"table.weight"}), ("other", other, set())):
        before = dict(calls)
        (record,) = profile_sparse_own(comm, {name: gradient}, tensors, lookups, lambda: torch.ones(64, 64).sum(), 60)
        out[name] = {k: calls[k] - before[k] for k in calls}
        out[name]["seconds"] = record[1].seconds
    comm.close()
    model, cfg, loss = Tables(), {"iterations": 2}, lambda m: loss_of(m, rank, 0)
    out["spared"] = spared_by_lookups(cfg, model, loss, together_timeline(cfg, model, loss), lookup_names(model))
    out["restored"] = not any(m.sparse or m._forward_hooks or m._forward_pre_hooks for m in model.modules()
                              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)))
    dist.barrier()
    return out


def test_looked_up_sparse_gives_coo_rows_and_leaves_the_model_as_declared():
    """The profile's backward with the tables looked up as DataParallel looks them up: the two
    tables that can (not the max bag) get COO gradients of the rows, equal to the dense ones; after
    it the model computes dense gradients again."""
    from sparcoll.plan.profiler import lookup_names, looked_up_sparse
    model = Tables()
    assert lookup_names(model) == {"table.weight", "bag.weight"}
    loss_of(model, 0, 0).backward()
    dense = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    with looked_up_sparse(model):
        loss_of(model, 0, 0).backward()
        assert {name for name, p in model.named_parameters() if p.grad.is_sparse} == {"table.weight", "bag.weight"}
        assert all(torch.allclose(p.grad.to_dense(), dense[name]) for name, p in model.named_parameters())
    model.zero_grad()
    loss_of(model, 0, 0).backward()
    assert not any(p.grad.is_sparse for p in model.parameters())


def test_the_profile_times_a_dense_declared_table_as_rows():
    for out in run_ranks(profiled, WORLD, timeout=120):
        assert out["table.weight"]["allreduce_coo"] > 0 and out["table.weight"]["allreduce"] == 0, out
        assert out["other"]["allreduce"] > 0 and out["other"]["allreduce_coo"] == 0, out
        assert out["table.weight"]["seconds"] > 0 and out["other"]["seconds"] > 0
        # the backward work the two lookups spare, measured for them alone, and the model left as declared
        assert set(out["spared"]) == {"table.weight", "bag.weight"} and out["restored"], out
        assert all(v["lookup_spared"] >= 0 and v["lookup_spared_cpu"] >= 0 for v in out["spared"].values()), out
