"""ByteComp's timeline simulator: the iteration time F of a strategy, from each tensor's backward ready
time and its option's costs.

Four lanes, as sparcoll.torch.DataParallel runs them:
  training thread  backward; a tensor compressed on it delays all later backward work by the
                   compression time (the gradients after it are ready that much later)
  offload lane     a worker thread that compresses offloaded tensors, one at a time, in backward order
  channel          the synchronization thread: one tensor at a time, in backward order, from the moment
                   its payload is ready; it communicates and then decompresses (the Reducer's order)
  gloo's lane      an uncompressed ring collective (`Cost.hold`): the synchronization thread starts it
                   on gloo and goes on to the next tensor; gloo runs them one at a time. It holds the
                   channel only for part of its time (its share of the link, or as long as the
                   profile saw it delay the next collective: costs.py): a collective after it waits
                   for that, not for the ring's latency
F = the last of: backward's end (delayed by on-thread compression), the channel's last finish, the
offload lane's last finish, gloo's last finish; plus the optimizer step, which waits for all of them.

That is ByteComp's model, with every operation taking the time it takes alone (`Simulation`: what
the decision searches with). `simulate` (what `sparcoll plan` reports and chooses among its
candidates by) predicts F no sooner than the workers' CPU allows: a step's CPU work on one worker
(forward, backward, the optimizer, and each option's compression, collective and decompression,
`Cost.cpu`) over the cores each worker has (`Step.cores`), plus the time after backward in which
every worker waits on its collectives with nothing to compute (the cores idle then). 4 workers on 2
cores ran their fastest strategies at 0.45-0.51 CPU seconds per second of step (ncf, deeplight,
gpt): there the CPU, not the channel, sets the step. Where each worker has a core or more (or the
cores are unknown), a collective that runs while backward computes takes longer and slows backward
down, as the profile measured per kind and size (`Cost.loaded`, `Cost.slowdown`), and `simulate`
prices that too; where workers share cores, that sharing is the CPU bound's, and the slowdowns
(measured with the training thread stepping back to back beside the collective, the cores busier
than in any step) would count it twice: deeplight's uniform sparse AllReduce, predicted 161.9 ms
with them and 129.0 without, ran 127.0-154.0 interleaved and 104.2-106.9 alone.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class Cost:
    """One tensor under one option, in seconds (0 compress: sent as it is; a negative one is backward
    work the option spares). `sooner`: the payload is ready that long before the gradient would be
    (SFB's factors: at the layer's output gradient, before its backward has run). `loaded`: the
    communication's time when it starts while backward computes (None: as `comm`); `slowdown`: how
    many times longer backward's work takes while it runs. `hold`: for a collective on gloo's lane
    (an uncompressed one on the ring, nothing to compress or decompress), how long it holds the
    channel; None: the channel's for its whole time. `cpu`: the CPU seconds all of it takes on one
    worker, every thread of the process (its compression, collective and decompression), of which
    `compress_cpu` its compression's; `cpu_loaded` the same with the collective's CPU as measured
    beside training (None: as `cpu`)."""
    compress: float = 0.0
    comm: float = 0.0
    decompress: float = 0.0
    offload: bool = False
    sooner: float = 0.0
    loaded: float | None = None
    slowdown: float = 1.0
    hold: float | None = None
    cpu: float = 0.0
    compress_cpu: float = 0.0
    cpu_loaded: float | None = None

    @property
    def in_training(self) -> float:
        """Its CPU seconds in training, beside the training thread (Step.cpu_bound)."""
        return self.cpu if self.cpu_loaded is None else self.cpu_loaded


@dataclass(frozen=True)
class Step:
    """A model's backward: `ready[i]` the time (from backward's start) tensor i's gradient is ready,
    in backward order; `backward_end` when backward has computed everything; `optimizer` the step
    after it. `cpu`: the CPU seconds of a step's forward, backward and optimizer on one worker,
    `cores` the cores each worker has (0: unknown, no CPU bound), `forward` the forward's time (F
    starts after it)."""
    ready: tuple[float, ...]
    backward_end: float
    optimizer: float = 0.0
    cpu: float = 0.0
    cores: float = 0.0
    forward: float = 0.0

    @property
    def shares_cores(self) -> bool:
        """Whether each worker has less than a core (4 workers on 2 cores)."""
        return 0 < self.cores < 1

    def cpu_bound(self, costs) -> float:
        """The least F the workers' CPU allows: the step's CPU work and every cost's in training
        (`Cost.in_training`: a collective's threads spend 16-19% more CPU in training than alone,
        docs/results/cpu-unpriced), spread over the worker's cores, less the forward (0 where the
        cores are unknown)."""
        if self.cores <= 0:
            return 0.0
        return (self.cpu + sum(c.in_training for c in costs)) / self.cores - self.forward


@dataclass
class Timeline:
    """Each tensor's times in one simulated iteration, F, and how long in it the cores stand idle
    while every worker waits (_idle; 0 where the cores are unknown)."""
    payload_ready: list[float]
    comm_start: list[float]
    comm_end: list[float]
    backward_end: float
    iteration: float
    idle: float = 0.0


State = tuple  # (on-thread compression so far, when the offload lane, the channel, gloo's lane are free)
START: State = (0.0, 0.0, 0.0, 0.0)


def advance(step: Step, state: State, i: int, cost: Cost) -> tuple[State, float, float]:
    """Tensor i through the lanes: the state after it, when its payload was ready and when its
    communication started."""
    delay, lane, channel, gloo = state
    ready = step.ready[i] + delay - cost.sooner
    if cost.compress and cost.offload:
        lane = ready = max(ready, lane) + cost.compress
    elif cost.compress:
        delay += cost.compress
        ready += cost.compress
    start = max(ready, channel)
    if cost.hold is None:
        return (delay, lane, start + cost.comm + cost.decompress, gloo), ready, start
    start = max(start, gloo)
    return (delay, lane, start + cost.hold, start + cost.comm + cost.decompress), ready, start


def finish(step: Step, state: State) -> float:
    """F: the optimizer's end, after backward, the offload lane, the channel and gloo's lane."""
    delay, lane, channel, gloo = state
    return max(step.backward_end + delay, channel, lane, gloo) + step.optimizer


def simulate(step: Step, costs) -> Timeline:
    """The timeline of one iteration with costs[i] for tensor i (in backward order), collectives and
    backward slowing each other down where the costs say how: a tensor's communication advances at
    comm / `loaded` of its rate alone while backward computes (its own work and the on-thread
    compression), and while it runs backward advances at 1 / `slowdown` of its rate alone. Backward's
    work is in seconds alone (the Step's ready times), turned into time along the channel's busy
    intervals so far (a tensor is ready before any later tensor's communication starts). A collective
    on gloo's lane holds the channel for its `hold` stretched as its time is under load, and slows
    backward for that long. None of this where the workers share cores (Step.shares_cores): the CPU
    bound prices that. F is at least the CPU's bound (Step.cpu_bound) plus the time the cores stand
    idle after backward (_idle). Without contention (no `loaded`, no CPU times) every operation takes
    its time alone, as in `Simulation`."""
    busy = _Busy()
    delay = lane = channel = gloo = 0.0
    payload, starts, ends = [], [], []
    for i, cost in enumerate(costs):
        work = step.ready[i] + delay - cost.sooner
        if cost.compress and cost.offload:
            lane = ready = max(busy.time_of(work), lane) + cost.compress
        else:
            if cost.compress:
                delay += cost.compress
                work += cost.compress
            ready = busy.time_of(work)
        start = max(ready, channel) if cost.hold is None else max(ready, channel, gloo)
        comm = cost.comm
        left = step.backward_end + delay - busy.work_at(start)       # backward's work still to do
        contended = cost.loaded is not None and left > 0 and not step.shares_cores
        if contended:
            comm = _under_load(cost, left * max(1.0, cost.slowdown))
        end = start + comm + cost.decompress
        held = end if cost.hold is None else start + min(comm, cost.hold * comm / max(cost.comm, 1e-12))
        if contended:
            busy.add(start, held, cost.slowdown)
        channel = held
        if cost.hold is not None:
            gloo = end
        payload.append(ready)
        starts.append(start)
        ends.append(end)
    backward_end = busy.time_of(step.backward_end + delay)
    waited = max(backward_end, channel, lane, gloo)
    idle = _idle(costs, payload, starts, ends, backward_end, waited, step.cores) if step.cores > 0 else 0.0
    return Timeline(payload, starts, ends, backward_end,
                    max(waited + step.optimizer, step.cpu_bound(costs) + idle), idle)


def _idle(costs, payload, starts, ends, backward_end: float, waited: float, cores: float) -> float:
    """How long the cores stand idle between backward's end and the optimizer (`waited`), when every
    worker waits for the same collectives: that time, less what the workers compute meanwhile (their
    offload lanes' compressions, and their collectives' and decompressions' CPU: a cost's CPU beyond
    its compression's, spread over its time on the channel), spread over the cores. Workers that
    share cores (`cores` each, below 1) keep them busy for a worker's work / `cores`: the cores'
    unused time, counted as F counts it (over all of them), is exactly that wait less that. 4 workers
    on 2 cores left them idle -0.3 to 3.0 ms a step on short waits, so priced 0.1-4.4, and 248.5-259.9
    on ncf's ring, priced 249.5 (docs/results/plan-e7fd6da); the slowest rank's step had seemed to show
    a floor of 5-9 ms, the ranks starting their steps apart (docs/results/step-skew)."""
    def after(start: float, end: float) -> float:
        return max(0.0, min(end, waited) - max(start, backward_end))
    work = 0.0
    for cost, ready, start, end in zip(costs, payload, starts, ends):
        if cost.compress > 0 and cost.offload:
            work += cost.compress_cpu * after(ready - cost.compress, ready) / cost.compress
        if end > start:
            work += max(0.0, cost.cpu - cost.compress_cpu) * after(start, end) / (end - start)
    return max(0.0, waited - backward_end - work / min(1.0, cores))


def _under_load(cost: Cost, overlap: float) -> float:
    """The communication's time when backward computes for the first `overlap` seconds of it: it
    advances at comm / loaded of its rate alone meanwhile, then at its rate alone."""
    loaded = max(cost.loaded, cost.comm)
    if overlap >= loaded or loaded <= 0:
        return loaded
    return cost.comm + overlap * (1 - cost.comm / loaded)


class _Busy:
    """The channel's intervals while backward computes, each with backward's slowdown in it: time
    (from backward's start) to backward's work done (in seconds alone) and back, by bisection."""

    def __init__(self):
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.slowdowns: list[float] = []
        self.work_starts: list[float] = []      # backward's work done at each interval's start
        self.work_ends: list[float] = []

    def add(self, start: float, end: float, slowdown: float) -> None:
        """An interval after every one before it."""
        work = self.work_at(start)
        slowdown = max(1.0, slowdown)
        self.starts.append(start)
        self.ends.append(end)
        self.slowdowns.append(slowdown)
        self.work_starts.append(work)
        self.work_ends.append(work + (end - start) / slowdown)

    def time_of(self, work: float) -> float:
        """When backward has done `work`."""
        k = bisect.bisect_right(self.work_starts, work) - 1
        if k < 0:
            return work
        if work <= self.work_ends[k]:
            return self.starts[k] + (work - self.work_starts[k]) * self.slowdowns[k]
        return self.ends[k] + work - self.work_ends[k]

    def work_at(self, time: float) -> float:
        """Backward's work done by `time` (the inverse of time_of)."""
        k = bisect.bisect_right(self.starts, time) - 1
        if k < 0:
            return time
        if time <= self.ends[k]:
            return self.work_starts[k] + (time - self.starts[k]) / self.slowdowns[k]
        return self.work_ends[k] + time - self.ends[k]


class Simulation:
    """The iteration time of a strategy, and of the same strategy with one tensor's cost changed, in
    constant time. Each tensor moves the lanes' state (delay, lane, channel, gloo) by maxima and sums
    only, so F as a function of the state before tensor j is max(gd + delay, gL + lane, gC +
    channel, gG + gloo) + optimizer for four numbers g[j] that follow from the tensors after j: kept for
    every j, with the state before every tensor. Setting a tensor's cost makes the states after it and
    the terms before it stale; they are brought up to date only as far as a question reads them
    (the greedy's questions move around the timeline: recomputing both sides in full on every
    change was half of its time)."""

    def __init__(self, step: Step, costs):
        self.step, self.costs = step, list(costs)
        n = len(self.costs)
        self.states = [START] * (n + 1)   # the state before tensor i (after the last: n)
        self.after = [(self.step.backward_end, 0.0, 0.0, 0.0)] * max(1, n)   # g for the state after i
        self._states_upto = 0           # states[0..this] are up to date
        self._after_from = max(0, n - 1)    # after[this..] are up to date
        self._state(n)
        self._terms(0)

    @property
    def iteration(self) -> float:
        """F of the current strategy."""
        return finish(self.step, self._state(len(self.costs)))

    def _state(self, i: int) -> State:
        """The state before tensor i, walking forward from the last one up to date."""
        for k in range(self._states_upto, i):
            self.states[k + 1] = advance(self.step, self.states[k], k, self.costs[k])[0]
        self._states_upto = max(self._states_upto, i)
        return self.states[i]

    def _terms(self, i: int) -> tuple:
        """g for the state after tensor i, walking backward from the first one up to date (F's
        terms after the last tensor are backward's end for the delay and nothing for the lanes)."""
        for j in range(self._after_from, i, -1):
            self.after[j - 1] = _before(self.after[j], self.step.ready[j], self.costs[j])
        self._after_from = min(self._after_from, i)
        return self.after[i]

    def with_cost(self, i: int, cost: Cost) -> float:
        """F if tensor i had `cost` and every other tensor its current one."""
        delay, lane, channel, gloo = advance(self.step, self._state(i), i, cost)[0]
        gd, gl, gc, gg = self._terms(i)
        return max(gd + delay, gl + lane, gc + channel, gg + gloo) + self.step.optimizer

    def set(self, i: int, cost: Cost) -> None:
        """Tensor i's cost changes: the states after it and the terms before it are stale."""
        self.costs[i] = cost
        self._states_upto = min(self._states_upto, i)
        self._after_from = max(self._after_from, i)


def _before(g: tuple, ready: float, cost: Cost) -> tuple:
    """F's terms (gd, gl, gc, gg) for the state before a tensor, from those for the state after it
    (advance, read backwards)."""
    gd, gl, gc, gg = g
    c, t, ready = cost.compress, cost.comm + cost.decompress, ready - cost.sooner
    if cost.hold is not None:       # starts at max(payload, channel, gloo); ends hold / t after
        if c and cost.offload:
            raise ValueError("a collective on gloo's lane has nothing to compress")
        k = max(gc + cost.hold, gg + t)
        return max(gd + c, k + ready + c), gl, k, k
    if c and cost.offload:
        return max(gd, gl + c + ready, gc + t + c + ready), max(gl + c, gc + t + c), gc + t, gg
    return max(gd + c, gc + ready + c + t), gl, gc + t, gg
