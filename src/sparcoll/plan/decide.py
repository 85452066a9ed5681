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

import itertools
from dataclasses import dataclass

import numpy as np

from .options import Option
from .timeline import Cost, Simulation, Step, advance, finish

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
        before = sim.iteration
        for i in order:
            if sim.with_cost(i, Cost()) >= sim.iteration:
                continue                     # its communication hides in a gap: nothing to gain
            best, best_f = current[i], sim.iteration
            for option in candidates[i]:
                if option == current[i]:
                    continue
                f = sim.with_cost(i, tensors[i].costs[option])
                if f < best_f:
                    best, best_f = option, f
            if best != current[i]:
                current[i] = best
                sim.set(i, tensors[i].costs[best])
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
    time allows); beyond, the states of smallest lower bound on F are kept."""
    n = len(tensors)
    beam = beam or max(16, BEAM_WORK // max(1, n))
    rest = [0.0] * (n + 1)          # the least channel time the tensors after i can take
    for i in reversed(range(n)):
        rest[i] = rest[i + 1] + min(tensors[i].costs[o].comm + tensors[i].costs[o].decompress
                                    for o in alternatives[i])
    layers = []                     # per tensor: [(state, parent index, option)]
    front = [((0.0, 0.0, 0.0), -1, None)]
    for i, t in enumerate(tensors):
        grown = [(advance(step, state, i, t.costs[alt])[0], parent, alt)
                 for parent, (state, _, _) in enumerate(front) for alt in alternatives[i]]
        front = _undominated(grown, beam, lambda s: max(step.backward_end + s[0], s[1], s[2] + rest[i + 1]))
        layers.append(front)
    best = min(range(len(front)), key=lambda k: finish(step, front[k][0]))
    out = []
    for layer in reversed(layers):
        _, parent, option = layer[best]
        out.append(option)
        best = parent
    return out[::-1]


def useful(choices: Choices) -> list[Option]:
    """The tensor's options that no other option of the same lane beats in compression time, channel
    time and how soon its payload is ready (a beaten one can never give a smaller F)."""
    costs = choices.costs
    return [o for o, c in costs.items() if not any(
        d.offload == c.offload and d.compress <= c.compress and d.comm + d.decompress <= c.comm + c.decompress
        and d.sooner >= c.sooner
        and (d.compress, d.comm + d.decompress, d.sooner) != (c.compress, c.comm + c.decompress, c.sooner)
        for d in costs.values())]


def _undominated(states: list, beam: int, bound) -> list:
    """The states no other state is at most in every lane (one of equal ones kept); of more than
    `beam`, those of smallest bound(lanes)."""
    lanes = np.array([s[0] for s in states])
    order = np.lexsort(lanes.T[::-1])              # lexicographic: a dominating state comes first
    lanes = lanes[order]
    # [j, i]: state j at most state i in every lane; for j < i the sort already gives the first
    at_most = lanes[:, None, 1] <= lanes[None, :, 1]
    at_most &= lanes[:, None, 2] <= lanes[None, :, 2]
    dominated = np.triu(at_most, k=1).any(axis=0)
    kept = [states[k] for k in order[~dominated]]
    if len(kept) > beam:
        kept = sorted(kept, key=lambda s: bound(s[0]))[:beam]
    return kept


def plan(step: Step, tensors: list[Choices]) -> list[Option]:
    """ByteComp's greedy decision and its offload search, and the frontier search over every useful
    option: whichever predicts the smaller F (the greedy alone can stop far from the best, the
    frontier search is exact while its frontier stays small enough to keep whole)."""
    options = [useful(t) for t in tensors]
    greedy_choice = greedy(step, tensors, options)
    candidates = [greedy_choice, offload_search(step, tensors, greedy_choice),
                  frontier(step, tensors, options)]
    return min(candidates, key=lambda c: Simulation(step, [t.costs[o] for t, o in zip(tensors, c)]).iteration)


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
