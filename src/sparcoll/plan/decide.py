"""The decision: one option per tensor, of smallest predicted iteration time F (timeline.py).

ByteComp's Algorithm 1 (`greedy`): every tensor starts uncompressed on its cheapest collective.
Tensors are taken largest first (ties: the one closer to the output, earlier in backward); a tensor
whose communication already hides in an idle gap of the channel (F does not change when it costs
nothing) keeps that; each other tensor gets the option of smallest F with every other tensor's
fixed (among its `useful` options: one that another beats in both compression and channel time
cannot lower F). Passes repeat while F falls. Then `offload_search`: with the options fixed, which compressed
tensors to compress on the offload lane instead of the training thread.

The greedy can stop far from the best (on random instances of 8 tensors, F up to 1.6x the best), so
`plan` also runs `frontier`, a search through backward order over every useful option that keeps
the undominated lane states (exact while they are few), and takes whichever predicts less.
`brute_force` and `brute_force_offload` check them on small models.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np

from .options import Option
from .timeline import Cost, Simulation, Step, simulate

MAX_PASSES = 4
BEAM_WORK = 2048    # the frontier search keeps up to this many states / tensors (at least 16)


@dataclass(frozen=True)
class Choices:
    """One tensor's valid options and what each costs (offloaded variants included)."""
    name: str
    numel: int
    costs: dict            # Option -> Cost


def uncompressed(choices: Choices) -> Option:
    """The tensor's cheapest uncompressed option (the starting point)."""
    plain = [o for o in choices.costs if o.compressor == "none"]
    return min(plain, key=lambda o: _total(choices.costs[o]))


def _total(cost: Cost) -> float:
    return cost.compress + cost.comm + cost.decompress


def greedy(step: Step, tensors: list[Choices], options: list[list[Option]] | None = None) -> list[Option]:
    """Algorithm 1 with compression on the training thread: one option per tensor (among
    options[i], default: its useful ones)."""
    current = [uncompressed(t) for t in tensors]
    sim = Simulation(step, [t.costs[o] for t, o in zip(tensors, current)])
    order = sorted(range(len(tensors)), key=lambda i: (-tensors[i].numel, i))
    options = options or [useful(t) for t in tensors]                           # the others never win
    candidates = [[o for o in each if not o.offload] for each in options]
    for _ in range(MAX_PASSES):
        before = f_now = sim.iteration
        for i in order:
            if sim.with_cost(i, Cost()) >= f_now:
                continue                     # its communication hides in a gap: nothing to gain
            best, best_f = current[i], f_now
            for option in candidates[i]:
                if option == current[i]:
                    continue
                f = sim.with_cost(i, tensors[i].costs[option])
                if f < best_f:
                    best, best_f = option, f
            if best != current[i]:
                current[i], f_now = best, best_f    # F as the change's question answered it:
                sim.set(i, tensors[i].costs[best])  # no walk over the whole timeline
        if sim.iteration >= before:
            break
    return current


def offloaded(option: Option) -> Option:
    return Option(option.compressor, option.collective, True)


def offload_search(step: Step, tensors: list[Choices], chosen: list[Option]) -> list[Option]:
    """Which compressed tensors to offload, the options fixed: the frontier search with each
    compressed tensor on the training thread or offloaded. ByteComp counts offloads per group of
    equal tensors instead, assuming which ones to offload is fixed by their order; on our lanes it
    is not (offloading the earlier of two equal tensors spares the backward work between them, but
    may queue behind the lane), so its search misses the best on some models; this one is exact
    while the frontier stays small enough to keep whole."""
    def alternatives(t: Choices, o: Option) -> list[Option]:
        return [o, offloaded(o)] if o.compressor != "none" and offloaded(o) in t.costs else [o]
    return frontier(step, tensors, [alternatives(t, o) for t, o in zip(tensors, chosen)])


def frontier(step: Step, tensors: list[Choices], alternatives: list[list[Option]],
             beam: int | None = None) -> list[Option]:
    """The best strategy with tensor i's option among alternatives[i]: a walk through backward
    order that keeps, per tensor, every lane state (on-thread delay, offload lane free, channel
    free) that no other state beats in all three lanes (F only grows with each of them). Exact
    while at most `beam` states are undominated (default: more for smaller models, as the decision
    time allows); beyond, the states of smallest lower bound on F are kept. Each tensor moves all
    kept states under all its alternatives at once (numpy: a Python step per state and option cost
    half the decision time of a 300-tensor model)."""
    n = len(tensors)
    beam = beam or max(16, BEAM_WORK // max(1, n))
    rest = [0.0] * (n + 1)          # the least channel time the tensors after i can take
    for i in reversed(range(n)):
        rest[i] = rest[i + 1] + min(_channel_time(tensors[i].costs[o]) for o in alternatives[i])
    lanes = np.zeros((1, 4))        # the kept states: (on-thread delay, offload lane, channel, gloo)
    layers = []                     # per tensor: the kept states' indices, parent * alternatives + option
    for i, t in enumerate(tensors):
        grown = _advance_all(step.ready[i], lanes, [t.costs[o] for o in alternatives[i]])
        # gloo's lane free before the channel is free for good: no later start or F depends on it
        grown[:, 3] = np.where(grown[:, 3] <= grown[:, 2], 0.0, grown[:, 3])
        bound = np.maximum.reduce([step.backward_end + grown[:, 0], grown[:, 1], grown[:, 2] + rest[i + 1],
                                   grown[:, 3]])
        kept = _undominated(grown, bound, beam)
        layers.append(kept)
        lanes = grown[kept]
    best = int(np.argmin(np.maximum.reduce([step.backward_end + lanes[:, 0], lanes[:, 1], lanes[:, 2],
                                            lanes[:, 3]])))
    out = []
    for i in reversed(range(n)):
        parent, option = divmod(int(layers[i][best]), len(alternatives[i]))
        out.append(alternatives[i][option])
        best = parent
    return out[::-1]


def _channel_time(cost: Cost) -> float:
    """How long the option holds the channel."""
    return cost.comm + cost.decompress if cost.hold is None else cost.hold


def _advance_all(ready: float, lanes: np.ndarray, costs: list[Cost]) -> np.ndarray:
    """timeline.advance for every state in `lanes` (S x 4) under every cost: (S * len(costs)) x 4,
    state-major."""
    table = np.array([(c.compress, c.comm, c.decompress, c.sooner, bool(c.compress and c.offload),
                       bool(c.compress and not c.offload), c.hold is not None, c.hold or 0.0) for c in costs])
    compress, comm, decompress, sooner = table[:, 0], table[:, 1], table[:, 2], table[:, 3]
    offloaded, on_thread = table[:, 4].astype(bool), table[:, 5].astype(bool)
    on_gloo, hold = table[:, 6].astype(bool), table[:, 7]
    delay, lane, channel, gloo = lanes[:, 0:1], lanes[:, 1:2], lanes[:, 2:3], lanes[:, 3:4]
    payload = ready + delay - sooner
    lane = np.where(offloaded, np.maximum(payload, lane) + compress, lane)
    payload = np.where(offloaded, lane, np.where(on_thread, payload + compress, payload))
    delay = np.where(on_thread, delay + compress, delay)
    start = np.maximum(payload, channel)
    start = np.where(on_gloo, np.maximum(start, gloo), start)
    channel = np.where(on_gloo, start + hold, start + comm + decompress)
    gloo = np.where(on_gloo, start + comm + decompress, gloo)
    return np.stack(np.broadcast_arrays(delay, lane, channel, gloo), axis=-1).reshape(-1, 4)


def useful(choices: Choices) -> list[Option]:
    """The tensor's options that no other option of the same lanes beats in compression time, channel
    time (and time on gloo's lane) and how soon its payload is ready (a beaten one can never give a
    smaller F)."""
    keys = {o: (c.offload, c.hold is None, c.compress, _channel_time(c),
                0.0 if c.hold is None else c.comm + c.decompress, -c.sooner) for o, c in choices.costs.items()}
    return [o for o, c in keys.items() if not any(
        d[:2] == c[:2] and d[2] <= c[2] and d[3] <= c[3] and d[4] <= c[4] and d[5] <= c[5] and d != c
        for d in keys.values())]


def _undominated(lanes: np.ndarray, bound: np.ndarray, beam: int) -> np.ndarray:
    """The indices of the states (rows of `lanes`) no other state is at most in every lane (one of
    equal ones kept); of more than `beam`, those of smallest `bound`."""
    order = np.lexsort(lanes.T[::-1])              # lexicographic: a dominating state comes first
    ordered = lanes[order]
    # [j, i]: state j at most state i in every lane; for j < i the sort already gives the first
    at_most = ordered[:, None, 1] <= ordered[None, :, 1]
    at_most &= ordered[:, None, 2] <= ordered[None, :, 2]
    at_most &= ordered[:, None, 3] <= ordered[None, :, 3]
    at_most &= _earlier(len(order))
    kept = order[~at_most.any(axis=0)]
    if len(kept) > beam:
        kept = kept[np.argsort(bound[kept], kind="stable")[:beam]]
    return kept


@functools.lru_cache(maxsize=64)
def _earlier(count: int) -> np.ndarray:
    """[j, i]: j < i (np.triu's mask, kept: building it took a fifth of the frontier search)."""
    return np.triu(np.ones((count, count), dtype=bool), k=1)


def plan(step: Step, tensors: list[Choices]) -> list[Option]:
    """ByteComp's greedy decision and its offload search, and the frontier search over every useful
    option: whichever predicts the smaller F with contention (timeline.simulate; the searches price
    operations alone). The greedy alone can stop far from the best, the frontier search is exact
    while its frontier stays small enough to keep whole."""
    options = [useful(t) for t in tensors]
    greedy_choice = greedy(step, tensors, options)
    candidates = [greedy_choice, offload_search(step, tensors, greedy_choice),
                  frontier(step, tensors, options)]
    return min(candidates, key=lambda c: predict(step, tensors, c))


def predict(step: Step, tensors: list[Choices], chosen: list[Option]) -> float:
    """F of a strategy, collectives and backward slowing each other down (timeline.simulate)."""
    return simulate(step, [t.costs[o] for t, o in zip(tensors, chosen)]).iteration


def brute_force(step: Step, tensors: list[Choices], offload: bool = False) -> tuple[list[Option], float]:
    """The best strategy by trying every combination (options on the training thread, or with
    `offload` every option): for checking the algorithm on small models."""
    per_tensor = [[o for o in t.costs if offload or not o.offload] for t in tensors]
    best = min(itertools.product(*per_tensor),
               key=lambda combo: Simulation(step, [t.costs[o] for t, o in zip(tensors, combo)]).iteration)
    return list(best), Simulation(step, [t.costs[o] for t, o in zip(tensors, best)]).iteration


def brute_force_offload(step: Step, tensors: list[Choices], chosen: list[Option]) -> float:
    """The best F over every subset of the compressed tensors offloaded, options fixed."""
    compressed = [i for i, o in enumerate(chosen) if o.compressor != "none" and offloaded(o) in tensors[i].costs]
    best = float("inf")
    for mask in range(1 << len(compressed)):
        strategy = list(chosen)
        for bit, i in enumerate(compressed):
            if mask >> bit & 1:
                strategy[i] = offloaded(chosen[i])
        best = min(best, Simulation(step, [t.costs[o] for t, o in zip(tensors, strategy)]).iteration)
    return best
