"""Error feedback (GRACE's Memory role): what a compressor dropped this step is added back next step,
so nothing is lost, only delayed: over any number of steps, sum(applied) + residual == sum(grads).

State is per tensor `key` (a parameter, a name). Sparse COO tensors keep a COO residual, so an
already-sparse gradient is never densified by its memory.
"""
from __future__ import annotations

import math

import torch

from .base import Entries
from .spec import OPTION_DEFAULTS


def _sparse_sum(a: torch.Tensor, b: torch.Tensor, finite: bool = False) -> torch.Tensor:
    """a + b without the entries that cancel to zero, so the residual does not grow; `finite`: NaN
    and infinities count as zero too."""
    total = (a + b).coalesce()
    values = total.values()     # the row width is spelled out: -1 cannot be inferred with no entries
    if finite:
        values = values.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    keep = values.reshape(values.shape[0], math.prod(values.shape[1:])).ne(0).any(dim=1)
    return torch.sparse_coo_tensor(total.indices()[:, keep], values[keep], total.shape,
                                   is_coalesced=True, check_invariants=False)


class NoMemory:
    """Error feedback off: the compressor's error is dropped."""
    active = False

    def compensate(self, x: torch.Tensor, key) -> torch.Tensor:
        return x

    def update(self, compensated: torch.Tensor, sent: torch.Tensor, key) -> None:
        pass

    def residual(self, key):
        return None

    def refusal(self, shape: tuple, key) -> ValueError | None:
        """Why a tensor of `shape` cannot be compensated under `key`, if it cannot."""
        return None


class Residual(NoMemory):
    """Residual error feedback: next step's input is the gradient plus what was not sent.

    A tensor that is all zeros on this rank (a parameter this step did not use) sends nothing of
    its residual: it keeps it for a step with a gradient. DDP(find_unused_parameters=True) drops
    the average of a parameter no rank used, so what its residual sent was lost; keeping it holds
    sum(applied) + residual == sum(grads) whatever the caller does with that average."""
    active = True

    def __init__(self):
        self.residuals: dict = {}
        self._idle: set = set()     # keys compensated without their residual: no update follows

    def refusal(self, shape: tuple, key) -> ValueError | None:
        held = self.residuals.get(key)
        if held is None or tuple(held.shape) == tuple(shape):
            return None
        return ValueError(f"key {key!r} holds the error feedback of a tensor of shape {tuple(held.shape)} "
                          f"(flattened), now given one of {tuple(shape)}: give each tensor its own key")

    def compensate(self, x: torch.Tensor, key) -> torch.Tensor:
        refused = self.refusal(x.shape, key)    # before any state changes: a broadcasting add
        if refused is not None:                 # changed the residual, then failed (a review)
            raise refused
        if not (x._nnz() if x.is_sparse else x.any()):
            self._idle.add(key)
            return x
        self._idle.discard(key)
        return self._compensate(x, key)

    def update(self, compensated: torch.Tensor, sent, key) -> None:
        """`sent`: a tensor like `compensated`, or Entries of a flat dense one."""
        if key not in self._idle:
            self._update(compensated, sent, key)

    def _compensate(self, x: torch.Tensor, key) -> torch.Tensor:
        r = self.residuals.get(key)
        if r is None and x.is_sparse:
            return x
        if r is None:
            # owned from the start: update() then works in place, and the caller's tensor may
            # receive the average before update() runs (PowerSGD writes it into the gradient)
            self.residuals[key] = x.clone()
            return self.residuals[key]
        if x.is_sparse and r.is_sparse:
            return _sparse_sum(x, r)
        # into the residual's own memory (no new tensor), which update() then reuses in place
        r = r.to_dense() if r.is_sparse else r
        return r.add_(x.to_dense() if x.is_sparse else x)

    def _update(self, compensated: torch.Tensor, sent, key) -> None:
        owned = compensated is self.residuals.get(key)     # else the caller's tensor: not in place
        if compensated.is_sparse:
            # A NaN or an infinity sent leaves NaN behind (inf - inf), which was then sent again every
            # step (a review: GradScaler would skip them all). Every COO entry compressor sends them
            # (a sparsifier picks them first, a cast keeps every entry): none is left to keep.
            self.residuals[key] = _sparse_sum(compensated, -sent, finite=True)
        elif isinstance(sent, Entries):
            # the sent entries are the compensated values themselves: their residual is 0 (zeroed,
            # not subtracted: an infinity sent would leave inf - inf = NaN behind for good)
            residual = compensated if owned else compensated.clone()
            self.residuals[key] = residual.index_fill_(0, sent.idx, 0.0)
        else:
            self.residuals[key] = compensated.sub_(sent) if owned else compensated - sent

    def residual(self, key):
        return self.residuals.get(key)


class Momentum(Residual):
    """DGC's momentum correction: accumulate the momentum u = m u + g into the velocity v and send
    from v; what was sent is cleared from both (momentum factor masking), so the optimizer itself
    should run without momentum. With momentum 0 it is plain residual feedback."""

    def __init__(self, momentum: float):
        super().__init__()
        self.momentum = momentum
        self.velocity: dict = {}

    def _compensate(self, x: torch.Tensor, key) -> torch.Tensor:
        x = x.to_dense() if x.is_sparse else x
        u = self.velocity.get(key)
        u = x.clone() if u is None else u.mul_(self.momentum).add_(x)
        self.velocity[key] = u
        return super()._compensate(u, key)

    def _update(self, compensated: torch.Tensor, sent, key) -> None:
        super()._update(compensated, sent, key)
        if isinstance(sent, Entries):
            self.velocity[key].index_fill_(0, sent.idx, 0.0)
        else:
            self.velocity[key].masked_fill_(sent != 0, 0.0)


def make_memory(spec) -> NoMemory:
    if not spec.ef:
        return NoMemory()
    if spec.name == "dgc":
        return Momentum(spec.options.get("momentum", OPTION_DEFAULTS["momentum"]))
    return Residual()
