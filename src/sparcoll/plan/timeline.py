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
    """One tensor under one option, in seconds (0 compress: sent as it is)."""
    compress: float = 0.0
    comm: float = 0.0
    decompress: float = 0.0
    offload: bool = False


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
    ready = step.ready[i] + delay
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
    """The iteration time of a strategy, re-simulating only from the tensor that changed: the lanes'
    state after each tensor of the current strategy is kept, and a candidate's simulation stops as
    soon as its state meets the current one again (the rest of the timeline is then the same)."""

    def __init__(self, step: Step, costs):
        self.step, self.costs = step, list(costs)
        self._rebuild()

    def _rebuild(self) -> None:
        self.states = [(0.0, 0.0, 0.0)]               # the state before tensor i
        for i, cost in enumerate(self.costs):
            self.states.append(advance(self.step, self.states[-1], i, cost)[0])
        self.iteration = finish(self.step, self.states[-1])

    def with_cost(self, i: int, cost: Cost) -> float:
        """F if tensor i had `cost` and every other tensor its current one."""
        state = advance(self.step, self.states[i], i, cost)[0]
        for j in range(i + 1, len(self.costs)):
            if state == self.states[j]:
                return self.iteration
            state = advance(self.step, state, j, self.costs[j])[0]
        return finish(self.step, state)

    def set(self, i: int, cost: Cost) -> None:
        self.costs[i] = cost
        self._rebuild()
