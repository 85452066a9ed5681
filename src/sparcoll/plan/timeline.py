"""ByteComp's timeline simulator: the iteration time F of a strategy, from each tensor's backward ready
time and its option's costs.

Three lanes, as sparcoll.torch.DataParallel runs them:
  training thread  backward; a tensor compressed on it delays all later backward work by the
                   compression time (the gradients after it are ready that much later)
  offload lane     a worker thread that compresses offloaded tensors, one at a time, in backward order
  channel          the synchronization thread: one tensor at a time, in backward order, from the moment
                   its payload is ready; it communicates and then decompresses (the Reducer's order)
F = the last of: backward's end (delayed by on-thread compression), the channel's last finish, the
offload lane's last finish; plus the optimizer step, which waits for all of them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cost:
    """One tensor under one option, in seconds (0 compress: sent as it is; a negative one is backward
    work the option spares). `sooner`: the payload is ready that long before the gradient would be
    (SFB's factors: at the layer's output gradient, before its backward has run)."""
    compress: float = 0.0
    comm: float = 0.0
    decompress: float = 0.0
    offload: bool = False
    sooner: float = 0.0


@dataclass(frozen=True)
class Step:
    """A model's backward: `ready[i]` the time (from backward's start) tensor i's gradient is ready,
    in backward order; `backward_end` when backward has computed everything; `optimizer` the step
    after it."""
    ready: tuple[float, ...]
    backward_end: float
    optimizer: float = 0.0


@dataclass
class Timeline:
    """Each tensor's times in one simulated iteration, and F."""
    payload_ready: list[float]
    comm_start: list[float]
    comm_end: list[float]
    backward_end: float
    iteration: float


State = tuple  # (on-thread compression so far, when the offload lane is free, when the channel is free)


def advance(step: Step, state: State, i: int, cost: Cost) -> tuple[State, float, float]:
    """Tensor i through the lanes: the state after it, when its payload was ready and when its
    communication started."""
    delay, lane, channel = state
    ready = step.ready[i] + delay - cost.sooner
    if cost.compress and cost.offload:
        lane = ready = max(ready, lane) + cost.compress
    elif cost.compress:
        delay += cost.compress
        ready += cost.compress
    start = max(ready, channel)
    return (delay, lane, start + cost.comm + cost.decompress), ready, start


def finish(step: Step, state: State) -> float:
    """F: the optimizer's end, after backward, the offload lane and the channel."""
    delay, lane, channel = state
    return max(step.backward_end + delay, channel, lane) + step.optimizer


def simulate(step: Step, costs) -> Timeline:
    """The timeline of one iteration with costs[i] for tensor i (in backward order)."""
    state: State = (0.0, 0.0, 0.0)
    payload, starts, ends = [], [], []
    for i, cost in enumerate(costs):
        state, ready, start = advance(step, state, i, cost)
        payload.append(ready)
        starts.append(start)
        ends.append(state[2])
    return Timeline(payload, starts, ends, step.backward_end + state[0], finish(step, state))


class Simulation:
    """The iteration time of a strategy, and of the same strategy with one tensor's cost changed, in
    constant time. Each tensor moves the lanes' state (delay, lane, channel) by maxima and sums
    only, so F as a function of the state before tensor j is max(gd + delay, gL + lane, gC +
    channel) + optimizer for three numbers g[j] that follow from the tensors after j: kept for every
    j, with the state before every tensor; setting a tensor's cost recomputes the states after it
    and the terms before it."""

    def __init__(self, step: Step, costs):
        self.step, self.costs = step, list(costs)
        self._rebuild()

    def _rebuild(self) -> None:
        n = len(self.costs)
        self.states = [(0.0, 0.0, 0.0)] * (n + 1)   # the state before tensor i (after the last: n)
        self.after = [(self.step.backward_end, 0.0, 0.0)] * max(1, n)   # g for the state after i
        self._forward(0)
        self._backward(n - 1)

    def _forward(self, first: int) -> None:
        """The states after tensors first, first + 1, ..., and F."""
        for i in range(first, len(self.costs)):
            self.states[i + 1] = advance(self.step, self.states[i], i, self.costs[i])[0]
        self.iteration = finish(self.step, self.states[-1])

    def _backward(self, last: int) -> None:
        """g for the states after tensors last - 1, last - 2, ..., 0 (F's terms after the last
        tensor are backward's end for the delay and nothing for the lanes)."""
        for j in range(last, 0, -1):
            self.after[j - 1] = _before(self.after[j], self.step.ready[j], self.costs[j])

    def with_cost(self, i: int, cost: Cost) -> float:
        """F if tensor i had `cost` and every other tensor its current one."""
        delay, lane, channel = advance(self.step, self.states[i], i, cost)[0]
        gd, gl, gc = self.after[i]
        return max(gd + delay, gl + lane, gc + channel) + self.step.optimizer

    def set(self, i: int, cost: Cost) -> None:
        """Tensor i's cost changes: the states after it and the terms before it."""
        self.costs[i] = cost
        self._forward(i)
        self._backward(i)


def _before(g: tuple, ready: float, cost: Cost) -> tuple:
    """F's terms (gd, gl, gc) for the state before a tensor, from those for the state after it
    (advance, read backwards)."""
    gd, gl, gc = g
    c, t, ready = cost.compress, cost.comm + cost.decompress, ready - cost.sooner
    if c and cost.offload:
        return max(gd, gl + c + ready, gc + t + c + ready), max(gl + c, gc + t + c), gc + t
    return max(gd + c, gc + ready + c + t), gl, gc + t
