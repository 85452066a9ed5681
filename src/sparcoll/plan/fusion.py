"""Units of one compressor, or of the uncompressed ring, fused into one collective after the decision.

The decision gives each unit (a tensor, a layer, a bucket of small tensors) its option, and the
timeline prices each unit's collective on its own. Every collective has a fixed cost besides its
bytes (about 5 ms among 4 processes on 2 cores), so gpt's 17 large compressed tensors, each in its
own collective, made DataParallel 1.6-1.8x slower than DDP's compression hook, which sends a few
25 MB buckets; the ring's large gradients, one allreduce each, made deeplight's ring for every tensor
115 ms a step against DDP's 72. Here consecutive units (in backward order) under the same compressor
and placement, or on the ring uncompressed, become one unit while the timeline predicts no slower a
step: one collective of all their payloads (Costing.bucket; on the ring one allreduce), ready with its
last member, which trades wait-free backpropagation's early start for fewer collectives.
sparcoll.torch.DataParallel sends a plan's unit of several tensors as one bucket, whatever their sizes.
"""
from __future__ import annotations

from typing import Callable

from .costs import Costing, Measured
from .decide import Choices
from .options import DEDICATED, SPARSE, Option, TensorFacts
from .timeline import Step, simulate


def fusable(option: Option, members: list[int], measured: list[Measured]) -> bool:
    """Whether a unit under `option` may share a collective with its neighbours: dense, and compressed
    or on the ring uncompressed (one allreduce of them all, as DDP's buckets); or sparse COO gradients
    under the sparse AllReduce uncompressed (one of their rows concatenated, sparcoll.torch.sparse)."""
    coo = [measured[i].facts.coo for i in members]
    if any(coo):
        return all(coo) and option.compressor == "none" and option.collective in (SPARSE, DEDICATED)
    return option.compressor != "none" or option == Option()


def coo_units(order: list[str], coo: set[str]) -> list[list[str]]:
    """The units of several COO gradients the profile times as one collective: in backward order
    (`order`), every run of consecutive COO gradients' prefixes of two or more. `fuse` joins a unit to
    the one before it, so such a unit grows from the first of its run (one that starts later is not
    priced, and stays apart)."""
    units, run = [], []
    for name in [*order, None]:
        if name in coo:
            run.append(name)
            continue
        units += [run[:k] for k in range(2, len(run) + 1)]
        run = []
    return units


def merged(members: list[int], option: Option, measured: list[Measured], costing: Costing) -> Choices | None:
    """A unit of `members` under `option`, priced as one collective of their payloads (on the ring
    uncompressed: one allreduce of all their elements; COO gradients: as the profile timed them
    concatenated, None where it did not)."""
    group = [measured[i] for i in members]
    name, numel = "+".join(t.facts.name for t in group), sum(t.facts.numel for t in group)
    if group[0].facts.coo:
        facts = TensorFacts(name, numel, coo=True)
        return Choices(name, numel, {option: costing.cost(Measured(facts, (numel,)), option)}) \
            if costing.priced_coo(name, option) else None
    cost = (costing.bucket(group, option) if option.compressor != "none"
            else costing.cost(Measured(TensorFacts(name, numel), (numel,)), option))
    return Choices(name, numel, {option: cost})


def whole_runs(previous: list[int], members: list[int]) -> bool:
    """`fuse`'s `joins` for every run of joinable neighbours in one collective. The greedy stops where
    one more join predicts a slower step and can stop short of a whole run that predicts faster: it
    left gpt's blocktopk in 14 collectives, 208-212 ms a step measured, one collective 162-174; and
    the model cannot be trusted to pick between them: it also predicted one collective faster for
    vgg, measured 5-16% slower in two rounds and level within the noise in two others. So the trial
    trains both (`sparcoll plan --fusion`)."""
    return True


def fuse(step: Step, measured: list[Measured], groups: list[list[int]], tensors: list[Choices],
         chosen: list[Option], costing: Costing, joins: Callable[[list[int], list[int]], bool] | None = None
         ) -> tuple[Step, list[list[int]], list[Choices], list[Option]]:
    """The plan's units with neighbours of one compressor merged where the timeline predicts a step
    no slower (greedy, in backward order: each unit joins the previous one if that predicts no worse),
    or where `joins(previous members, members)` says so. A COO unit looks further: it joins with the
    units after it up to whichever end of their run predicts the fastest step, if any is no slower
    than apart (the profile timed only such prefixes together, and ncf's first two embeddings
    together took longer than apart, all four together a third less). Returns the new units' Step,
    members, Choices and options."""
    ready = list(step.ready)
    costs = [t.costs[o] for t, o in zip(tensors, chosen)]

    def predicted(head_costs: list, head_ready: list, i: int) -> float:
        """F with the units up to i as given and the later ones as decided."""
        return simulate(Step(tuple(head_ready + ready[i + 1:]), step.backward_end, step.optimizer),
                        head_costs + costs[i + 1:]).iteration

    def may_join(k: int) -> bool:
        return chosen[k] == out_chosen[-1] and fusable(chosen[k], groups[k], measured)

    def joined_through(i: int) -> tuple[int, list[int], Choices] | None:
        """The last unit that unit i joins the previous one up to, the members and the joined unit;
        None if it stays apart."""
        o = chosen[i]
        ends = [i]
        if joins is None and measured[groups[i][0]].facts.coo:
            while ends[-1] + 1 < len(groups) and may_join(ends[-1] + 1):
                ends.append(ends[-1] + 1)
        apart = None if joins is not None else predicted(out_costs + [costs[i]], out_ready + [ready[i]], i)
        best, best_f = None, None
        for k in ends:
            members = out_groups[-1] + [m for g in groups[i:k + 1] for m in g]
            joined = merged(members, o, measured, costing)
            if joined is None:
                continue
            if joins is not None:
                return (k, members, joined) if joins(out_groups[-1], groups[i]) else None
            f = predicted(out_costs[:-1] + [joined.costs[o]], out_ready[:-1] + [ready[k]], k)
            if f <= apart and (best_f is None or f < best_f):
                best, best_f = (k, members, joined), f
        return best

    out_groups, out_tensors, out_chosen, out_ready, out_costs = [], [], [], [], []
    i = 0
    while i < len(groups):
        through = joined_through(i) if out_chosen and may_join(i) and fusable(chosen[i], out_groups[-1], measured) \
            else None
        if through is not None:
            k, members, joined = through
            out_groups[-1] = members
            out_tensors[-1], out_ready[-1], out_costs[-1] = joined, ready[k], joined.costs[chosen[i]]
            i = k + 1
            continue
        out_groups.append(list(groups[i]))
        out_tensors.append(tensors[i])
        out_chosen.append(chosen[i])
        out_ready.append(ready[i])
        out_costs.append(costs[i])
        i += 1
    return Step(tuple(out_ready), step.backward_end, step.optimizer), out_groups, out_tensors, out_chosen


def as_planned(step: Step, measured: list[Measured], groups: list[list[int]], tensors: list[Choices],
               chosen: list[Option], costing: Costing, plan_units: dict[str, int]):
    """The decided units regrouped as a plan (tensor name -> unit) fused them: its Step, Choices and
    options, for predicting a plan that was made from another profile."""
    def same_unit(previous: list[int], members: list[int]) -> bool:
        return plan_units[measured[previous[-1]].facts.name] == plan_units[measured[members[-1]].facts.name]
    unit_step, _, unit_tensors, unit_chosen = fuse(step, measured, groups, tensors, chosen, costing, same_unit)
    return unit_step, unit_tensors, unit_chosen
