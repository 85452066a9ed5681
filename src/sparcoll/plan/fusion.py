"""Units of one compressor, or of the uncompressed ring, fused into one collective after the decision.

The decision gives each unit (a tensor, a layer, a bucket of small tensors) its option, and the
timeline prices each unit's collective on its own. Every collective has a fixed cost besides its
bytes (about 5 ms among 4 processes on 2 cores), so gpt's 17 large compressed tensors, each in its
own collective, made DataParallel 1.6-1.8x slower than DDP's compression hook, which sends a few
25 MB buckets; the ring's large gradients, one allreduce each, made deeplight's ring for every tensor
115 ms a step against DDP's 72. Here units (in backward order) under the same compressor and
placement, on the ring uncompressed, or dense under the sparse AllReduce uncompressed, become one unit
while the timeline predicts no slower a step: one collective of all their payloads (Costing.bucket;
on the ring one allreduce; under the sparse AllReduce concatenated, up to 1 MB), ready with its last
member, which trades wait-free backpropagation's early start for fewer collectives. A unit joins
the latest unit of its option even past units of other options: deeplight's dense_embedding, ready
between its two COO embeddings, joined the MLP's blocktopk collective that way, and its step went from
0.92-0.94x DDP's to 0.97x (docs/benchmarks-log.md). sparcoll.torch.DataParallel sends a plan's unit of
several tensors as one bucket, whatever their sizes, as soon as all of them are ready.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from sparcoll.torch.parallel import BUCKET_BYTES

from .costs import ITEMSIZE, Costing, Measured
from .decide import Choices
from .options import Option, TensorFacts
from .timeline import Step, simulate


def fusable(option: Option, members: list[int], measured: list[Measured]) -> bool:
    """Whether a unit under `option` may share a collective with its neighbours: dense, and compressed,
    on the ring uncompressed (one allreduce of them all, as DDP's buckets) or under the sparse
    AllReduce uncompressed (concatenated, up to BUCKET_BYTES in all: `merged`); or sparse COO
    gradients under the sparse AllReduce uncompressed (one of their rows concatenated,
    sparcoll.torch.sparse)."""
    coo = [measured[i].facts.coo for i in members]
    if any(coo):
        return all(coo) and option.uncompressed_sparse
    return option.compressor != "none" or option == Option() or option.uncompressed_sparse


def coo_units(order: list[str], coo: set[str]) -> list[list[str]]:
    """The units of several COO gradients the profile times as one collective: the prefixes of two or
    more of the COO gradients in backward order (`order`), whatever is ready between them. `fuse`
    joins a unit to the latest one of its option, so such a unit grows from the first COO gradient
    (one that starts later is not priced, and stays apart)."""
    run = [name for name in order if name in coo]
    return [run[:k] for k in range(2, len(run) + 1)]


def merged(members: list[int], option: Option, measured: list[Measured], costing: Costing) -> Choices | None:
    """A unit of `members` under `option`, priced as one collective of their payloads (on the ring
    uncompressed: one allreduce of all their elements; under the sparse AllReduce uncompressed: one
    of them concatenated, at their mean densities, None beyond BUCKET_BYTES; COO gradients: as the
    profile timed them concatenated, None where it did not)."""
    group = [measured[i] for i in members]
    name, numel = "+".join(t.facts.name for t in group), sum(t.facts.numel for t in group)
    if group[0].facts.coo:
        facts = TensorFacts(name, numel, coo=True)
        return Choices(name, numel, {option: costing.cost(Measured(facts, (numel,)), option)}) \
            if costing.priced_coo(name, option) else None
    if option.compressor != "none":
        return Choices(name, numel, {option: costing.bucket(group, option)})
    if option.uncompressed_sparse and numel * ITEMSIZE > BUCKET_BYTES:     # DataParallel: one by one
        return None
    density, union = (sum(getattr(t, k) * t.facts.numel for t in group) / numel for k in ("density", "union"))
    return Choices(name, numel, {option: costing.cost(Measured(TensorFacts(name, numel), (numel,), 0, density,
                                                                union), option)})


def whole_runs(previous: list[int], members: list[int]) -> bool:
    """`fuse`'s `joins` for all the units of one option that may share, in one collective. The greedy
    stops where one more join predicts a slower step and can stop short of a whole that predicts faster: it
    left gpt's blocktopk in 14 collectives, 208-212 ms a step measured, one collective 162-174; and
    the model cannot be trusted to pick between them: it also predicted one collective faster for
    vgg, measured 5-16% slower in two rounds and level within the noise in two others. So the trial
    trains both (`sparcoll plan --fusion`)."""
    return True


def fuse(step: Step, measured: list[Measured], groups: list[list[int]], tensors: list[Choices],
         chosen: list[Option], costing: Costing, joins: Callable[[list[int], list[int]], bool] | None = None
         ) -> tuple[Step, list[list[int]], list[Choices], list[Option]]:
    """The plan's units with those of one compressor merged where the timeline predicts a step no
    slower (greedy, in backward order: each unit joins the latest fused unit of its option, which then
    comes after the units between them, if that predicts no worse), or where `joins(its members,
    members)` says so. A COO unit looks further: it joins with the COO units after it up to whichever
    predicts the fastest step, if any is no slower than apart (the profile timed only such prefixes
    together, and ncf's first two embeddings together took longer than apart, all four together a
    third less). Returns the new units' Step, members, Choices and options."""
    ready = list(step.ready)
    costs = [t.costs[o] for t, o in zip(tensors, chosen)]

    def predicted(head_costs: list, head_ready: list, i: int) -> float:
        """F with the units up to i as given and the later ones as decided."""
        return simulate(replace(step, ready=tuple(head_ready + ready[i + 1:])),
                        head_costs + costs[i + 1:]).iteration

    def target(i: int) -> int | None:
        """The fused unit that unit i may join: the latest of its option, if both may share."""
        same = [j for j, o in enumerate(out_chosen) if o == chosen[i]]
        # the two together: COO gradients never join dense ones (each kind its own collective)
        if not same or not fusable(chosen[i], out_groups[same[-1]] + groups[i], measured):
            return None
        return same[-1]

    def joined_through(i: int, j: int) -> tuple[int, list[int], Choices] | None:
        """The last unit that unit i joins fused unit j up to (i, or for COO gradients a later unit of
        theirs), the members and the joined unit; None if it stays apart."""
        o = chosen[i]
        ends = [i]
        if joins is None and measured[groups[i][0]].facts.coo:
            while ends[-1] + 1 < len(groups) and chosen[ends[-1] + 1] == o \
                    and fusable(o, groups[i] + groups[ends[-1] + 1], measured):
                ends.append(ends[-1] + 1)
        apart = None if joins is not None else predicted(out_costs + [costs[i]], out_ready + [ready[i]], i)
        best, best_f = None, None
        for k in ends:
            members = out_groups[j] + [m for g in groups[i:k + 1] for m in g]
            joined = merged(members, o, measured, costing)
            if joined is None:
                continue
            if joins is not None:
                return (k, members, joined) if joins(out_groups[j], groups[i]) else None
            f = predicted(out_costs[:j] + out_costs[j + 1:] + [joined.costs[o]],
                          out_ready[:j] + passed(j) + [ready[k]], k)
            if f <= apart and (best_f is None or f < best_f):
                best, best_f = (k, members, joined), f
        return best

    def passed(j: int) -> list[float]:
        """The ready times of the units after unit j, once j's members join a unit after them: j's
        compression on the training thread still runs in its members' gradient hooks, where they
        are ready, and delays everything backward computes after them (the timeline charges a
        unit's compression where the unit is)."""
        compress = out_costs[j].compress if out_costs[j].compress > 0 and not out_costs[j].offload else 0.0
        return [r + compress for r in out_ready[j + 1:]]

    out_groups, out_tensors, out_chosen, out_ready, out_costs = [], [], [], [], []
    i = 0
    while i < len(groups):
        j = target(i)
        through = None if j is None else joined_through(i, j)
        if through is not None:         # the joined unit goes after those ready before its last member
            k, members, joined = through
            out_ready[j + 1:] = passed(j)
            for out in (out_groups, out_tensors, out_chosen, out_ready, out_costs):
                del out[j]
            out_groups.append(members)
            out_tensors.append(joined)
            out_chosen.append(chosen[i])
            out_ready.append(ready[k])
            out_costs.append(joined.costs[chosen[i]])
            i = k + 1
            continue
        out_groups.append(list(groups[i]))
        out_tensors.append(tensors[i])
        out_chosen.append(chosen[i])
        out_ready.append(ready[i])
        out_costs.append(costs[i])
        i += 1
    return replace(step, ready=tuple(out_ready)), out_groups, out_tensors, out_chosen


def as_planned(step: Step, measured: list[Measured], groups: list[list[int]], tensors: list[Choices],
               chosen: list[Option], costing: Costing, plan_units: dict[str, int]):
    """The decided units regrouped as a plan (tensor name -> unit) fused them: its Step, Choices and
    options, for predicting a plan that was made from another profile."""
    def same_unit(previous: list[int], members: list[int]) -> bool:
        return plan_units[measured[previous[-1]].facts.name] == plan_units[measured[members[-1]].facts.name]
    unit_step, _, unit_tensors, unit_chosen = fuse(step, measured, groups, tensors, chosen, costing, same_unit)
    return unit_step, unit_tensors, unit_chosen
