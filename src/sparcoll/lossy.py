"""The protocol over a transport that may lose, duplicate or reorder messages (e.g. a future UDP one).

An extension of the streams in `protocol`, used today only by the simulations in the tests: messages
carry sequence numbers, anything but the next expected message is dropped (so nothing is counted
twice), a worker retransmits its unacknowledged messages and asks again for results after a timeout of
its driver (each message piggybacks `ack`, the next result it expects), and an aggregator keeps each
result until every worker acknowledged it. Sums are never accumulated in a contribution's memory here:
kept results must outlive it.
"""
from __future__ import annotations

from collections import deque

import numpy as np
import torch

from .errors import ProtocolError
from .lease import Lease
from .protocol import AggregatorStream, Result, Send, Step, WorkerStream


class LossyWorkerStream(WorkerStream):
    """A worker's range whose duplicate and out-of-order results are dropped, not refused."""

    def retransmit(self) -> list[Send]:
        """After a timeout: every message not yet covered by a result, in order (the aggregator drops
        those it already has). With none, the driver sends just its ack."""
        return list(self._unacked)

    def _out_of_sequence(self, seq: int) -> bool:
        return False


class LossyAggregatorStream(AggregatorStream):
    """An aggregator's range that drops duplicates and gaps and keeps results until acknowledged."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._kept: deque[Result] = deque()        # results some worker has not acked
        self._acked = [0] * self.workers            # next result seq each worker expects

    @property
    def finished(self) -> bool:
        """Done, and every worker has acknowledged every result: the state can go."""
        return self.done and not self._kept

    def on_ack(self, worker: int, ack: int) -> Step:
        """A worker expects result `ack` next: forget what everyone has, and send that worker again
        what it lacks."""
        if not 0 <= worker < self.workers or not 0 <= ack <= self._result_seq:
            raise ProtocolError(f"worker {worker}: ack {ack} of {self._result_seq} results")
        self._acked[worker] = max(self._acked[worker], ack)
        while self._kept and self._kept[0].seq < min(self._acked):
            self._kept.popleft()
        return Step(accepted=False, resend=[r for r in self._kept if r.seq >= self._acked[worker]])

    def on_contribution(self, worker: int, seq: int, progress: int, descriptor: tuple,
                        indices: np.ndarray, rows: torch.Tensor, lease: Lease | None = None,
                        ack: int = 0) -> Step:
        """As AggregatorStream's, with `ack` piggybacked; a message out of sequence (a duplicate, or
        one after a lost message) is dropped and only its ack is taken."""
        self._check_sender(worker, descriptor)
        if seq != self._seq[worker]:
            step = self.on_ack(worker, ack)
            step.released.append(lease)
            return step
        step = self._take(worker, progress, indices, rows, lease, reuse=0)
        if step.result is not None:
            self._kept.append(step.result)
        self.on_ack(worker, ack)
        return step
