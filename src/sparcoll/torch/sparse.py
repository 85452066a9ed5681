"""All-reduce of sparse COO tensors (e.g. `nn.Embedding(sparse=True)` gradients) on sparcoll.

`Communicator.allreduce_coo` reduces block-sparse without densifying and returns a new tensor; torch
collectives work in place, so `allreduce_coo` here copies the result back into the caller's tensor
before completion. `concatenate` and `split` let several COO tensors share one collective (a plan's
unit of embedding gradients in sparcoll.torch.DataParallel): each collective has a fixed cost besides
its rows.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

import sparcoll
from sparcoll.blocks import entries_of, entry_width
from sparcoll.communicator import Communicator
from sparcoll.wire import OPS


def allreduce_coo(tensor: torch.Tensor, op: str, comm: Communicator) -> sparcoll.Work:
    """Start reducing `tensor` in place; the returned Work completes once the result is in it."""
    if op not in OPS:
        raise ValueError(f"sparse all_reduce supports {', '.join(OPS)}, not {op!r}")
    work = comm.allreduce_coo(tensor, op=op, async_op=True)
    # Registered first, so it runs before the callbacks that complete the caller's future; should it
    # raise, the Work fails (engine.Work._finish) and so does that future.
    work.add_done_callback(lambda done: done.exception() is None and copy_into(tensor, done.tensor))
    return work


def copy_into(tensor: torch.Tensor, total: torch.Tensor) -> None:
    """The sum into the caller's tensor, as data: one that requires grad is reduced in place as a
    dense one is (an in-place copy into it under autograd raised, and the rank read its own input
    back as the sum)."""
    with torch.no_grad():
        tensor.copy_(total)


def sparse_weights(module: nn.Module) -> set[int]:
    """The ids of `module`'s weights whose gradients are sparse COO: those of nn.Embedding and
    nn.EmbeddingBag with sparse=True."""
    return {id(m.weight) for m in module.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}


class Lookups:
    """Embeddings declared with dense gradients that look their rows up with sparse=True while the
    wrapper runs them (those whose weight `wanted` says the sparse AllReduce takes): autograd then
    hands their weight a COO gradient of the rows looked up, which goes through the sparse AllReduce
    as it is, where the dense gradient (a zeroed table with those rows added) had to be scanned for
    its non-zero blocks (deeplight's 68 MB table: a pass over all of it each step). Where anything
    else adds to the weight's gradient (a regularizer, a tied use, a gradient accumulated dense),
    autograd sums the two dense, and the dense gradient goes as before. as_declared makes the sum
    dense again, as the module's owner declared it (an optimizer may not take COO gradients), in a
    KeptTables table."""

    def __init__(self, module: nn.Module, wanted):
        self._weights: set[int] = set()
        self._tables = KeptTables()
        self.handles = []
        for m in dense_lookups(module):
            if not wanted(m.weight):
                continue
            self._weights.add(id(m.weight))
            self.handles += [m.register_forward_pre_hook(_look_up_sparse),
                             m.register_forward_hook(_restore_dense, always_call=True)]

    def __contains__(self, weight_id: int) -> bool:
        return weight_id in self._weights

    def as_declared(self, weight: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        """A reduced gradient of `weight` in the layout its module declared."""
        if not total.is_sparse or id(weight) not in self._weights:
            return total
        return self._tables.write(id(weight), total)


class KeptTables:
    """Dense tables that COO sums of rows are written into, kept from step to step (as DDP's
    gradient_as_bucket_view keeps its buckets): only the rows the last sum wrote are zeroed again, not
    the whole table (deeplight's: 4.3 ms a step on one core for to_dense), unless the table changed
    since (its version counter: an in-place change by the caller, such as clipping, a noise, or
    zero_grad(set_to_none=False)), which zeroes all of it."""

    def __init__(self):
        self._tables: dict = {}     # key -> (table, the rows the last sum wrote, the table's version after it)

    def write(self, key, total: torch.Tensor) -> torch.Tensor:
        """The dense table of `key` holding the COO tensor `total` (a row index per entry) alone."""
        kept = self._tables.get(key)
        if kept is None or kept[0].shape != total.shape or kept[0].dtype != total.dtype:
            table = torch.zeros(total.shape, dtype=total.dtype)
        else:
            table, written, version = kept
            if table._version == version:
                table.index_fill_(0, written, 0)
            else:
                table.zero_()
        total = total.coalesce()        # one value a row (the collectives' sums are coalesced already)
        rows = total.indices()[0]
        table.index_copy_(0, rows, total.values())
        self._tables[key] = (table, rows, table._version)
        return table


def dense_lookups(module: nn.Module) -> list[nn.Module]:
    """`module`'s embeddings declared with dense gradients that can look up sparse (an EmbeddingBag in
    "max" mode has no sparse gradient in torch)."""
    return [m for m in module.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and not m.sparse
            and getattr(m, "mode", "sum") != "max"]


def _look_up_sparse(module: nn.Module, args) -> None:
    module.sparse = True


def _restore_dense(module: nn.Module, args, output) -> None:
    module.sparse = False


def zeros_like(weight: torch.Tensor) -> torch.Tensor:
    """An embedding weight's gradient with no rows: what a rank that did not use it contributes."""
    return torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.long),
                                   torch.zeros((0, *weight.shape[1:]), dtype=weight.dtype),
                                   weight.shape, is_coalesced=True, check_invariants=True)


def concatenate(coos: list[torch.Tensor]) -> torch.Tensor:
    """Coalesced COO tensors of one dtype as one 2-D COO tensor whose rows are pieces of theirs, `g`
    elements wide (the greatest common divisor of their entries' widths), the tensors' rows one after
    the other: its row block-sparsity is theirs, so one sparse AllReduce of it carries what one of each
    would. `split` takes the result apart."""
    g = math.gcd(*(entry_width(c) for c in coos))
    indices, values, offset = [], [], 0
    for c in coos:
        per = entry_width(c) // g
        linear = np.ravel_multi_index(c.indices().numpy(), c.shape[:c.sparse_dim()]) if c._nnz() else \
            np.zeros(0, dtype=np.int64)
        indices.append((linear[:, None] * per + np.arange(per)).reshape(-1) + offset)
        values.append(c.values().reshape(-1, g))
        offset += entries_of(c) * per
    # sorted and distinct by construction (each input coalesced, the offsets ascending)
    return torch.sparse_coo_tensor(torch.from_numpy(np.concatenate(indices))[None], torch.cat(values),
                                   (offset, g), is_coalesced=True, check_invariants=False)


def allreduce_many(coos: list[torch.Tensor], op: str, comm: Communicator,
                   tag: int = 0) -> list[torch.Tensor]:
    """Several COO tensors reduced in one collective of `comm` (concatenated, then split; one alone
    as it is), tagged `tag` (Communicator.allreduce): each result coalesced, of its input's shape."""
    coalesced = [c.coalesce() for c in coos]
    if len(coalesced) == 1:
        return [comm.allreduce_coo(coalesced[0], op=op, tag=tag).coalesce()]
    return split(comm.allreduce_coo(concatenate(coalesced), op=op, tag=tag), coalesced)


def split(total: torch.Tensor, likes: list[torch.Tensor]) -> list[torch.Tensor]:
    """`concatenate`'s inverse: the coalesced COO tensor of each of `likes` (shapes) from a coalesced
    result of its concatenation."""
    total = total.coalesce()
    g = total.shape[1]
    rows, values = total.indices()[0].numpy(), total.values()
    bounds = np.cumsum([0] + [entries_of(c) * (entry_width(c) // g) for c in likes])
    cuts = np.searchsorted(rows, bounds)
    out = []
    for c, start, lo, hi in zip(likes, bounds, cuts, cuts[1:]):
        per = entry_width(c) // g
        # a block of the result may hold a piece of an entry no rank sent (zeros): entries are
        # assembled from the pieces that came back, the missing ones zero
        pieces = rows[lo:hi] - start
        linear, inverse = np.unique(pieces // per, return_inverse=True)
        entry = torch.zeros(linear.size, per, g, dtype=values.dtype)
        entry[torch.from_numpy(inverse), torch.from_numpy(pieces % per)] = values[lo:hi]
        coords = np.stack(np.unravel_index(linear, c.shape[:c.sparse_dim()])).reshape(c.sparse_dim(), -1)
        out.append(torch.sparse_coo_tensor(torch.from_numpy(coords), entry.reshape(-1, *c.shape[c.sparse_dim():]),
                                           c.shape, is_coalesced=True, check_invariants=False))
    return out
