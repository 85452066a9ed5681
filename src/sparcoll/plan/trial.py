"""`sparcoll plan`'s trial: the few strategies the cost models rank highest, each trained for a few
steps on the job's own network, and the fastest measured kept.

The cost models price each operation as the profile timed it, every worker doing the same thing at
once. In training, backward, the synchronization threads and colocated aggregators of all workers
share the cores and their memory bandwidth, which no per-operation timing sees: on vgg (4 workers on
2 cores) blocktopk on the 400 MB layer was predicted 4% faster than SFB and measured 1.4-2x slower.
So the decision narrows the options to a handful (the plan, the planner without each dimension, the
uniform strategies it predicts best, and the plan and the best of those with their units fused the
other way, which the model cannot rank either: fusion.whole_runs), and a short run of each decides
among them. Candidates within MARGIN of the fastest count as level (a few steps are noisy): of those
a lossless one is kept if there is one, then the one the model predicts fastest if it predicts it
more than MARGIN ahead of the others, else the fastest measured of those it predicts level (choose).
A candidate whose steps are short trains for at least SECONDS (by its predicted step, at most
MOST_STEPS): three steps of ncf, 70 ms each, had the plan and the planner without compression 76.0
and 76.3 ms apart, which longer rounds then measured 3-8% apart.
The candidates train interleaved, a step of each in turn, in one job per pass (`sparcoll train
--interleave`), where every candidate's model fits in memory at once (fits_interleaved); else each in
jobs of its own, PASSES of them, in reversed order on every other pass (measure says why).
"""
from __future__ import annotations

import math
import statistics
from typing import Callable, NamedTuple

from sparcoll.bench.launch import BenchError
from sparcoll.bench.memory import meminfo, took_fresh_memory
from sparcoll.torch.parallel import STRATEGIES
from sparcoll.train.command import launch, timed_steps

MARGIN = 0.03
PLANNED = "planned"
SECONDS = 2.0           # each candidate trains at least this long (by its predicted step) ...
MOST_STEPS = 30         # ... in at most this many steps
PASSES = 2              # each candidate trains this many times, in alternating order (measure)
DDP = "ddp"             # the reference's name among the jobs of measure
# An interleaved job holds every candidate's model in every worker: parameters, gradients, error
# feedback and buffers, about 16 bytes a parameter (vgg, 138M parameters: about 2.5 GB a mode and
# worker); it runs where that takes at most MEMORY_SHARE of the memory available.
BYTES_PER_PARAMETER = 16
MEMORY_SHARE = 0.5


class Measured(NamedTuple):
    step_s: dict[str, float]        # each candidate that ran: its mean step over its passes
    failed: dict[str, str]          # each candidate that failed: why
    reference: dict                 # DDP on gloo: step_s and comm_share, or failed (empty if not asked)
    passes: dict[str, list[float]]  # each candidate that ran: its mean step in each pass


def steps_of(plan: dict, steps: int) -> int:
    """The timed steps of a candidate: at least `steps`, and enough for SECONDS of its predicted step."""
    predicted = plan.get("predicted_step_s") or 0.0
    return max(steps, min(MOST_STEPS, math.ceil(SECONDS / predicted))) if predicted > 0 else steps


def signature(plan: dict) -> tuple:
    """What DataParallel executes of a plan: each tensor's strategy, where it is compressed, and
    which collective (unit) it shares."""
    return tuple((t["name"], t["strategy"], t["placement"], t.get("unit")) for t in plan["tensors"])


def candidates(plan: dict, others: dict[str, dict]) -> dict[str, dict]:
    """The plan first, then each other plan (by name) that executes differently from all before it."""
    out, seen = {PLANNED: plan}, {signature(plan)}
    for name, other in others.items():
        if signature(other) not in seen:
            seen.add(signature(other))
            out[name] = other
    return out


def lossless(plan: dict) -> bool:
    """Whether a plan sends every gradient uncompressed (its average is DDP's)."""
    return all(t["strategy"] in STRATEGIES for t in plan["tensors"])     # DataParallel's uncompressed ones


def choose(step_s: dict[str, float], lossless_ones=frozenset(), margin: float = MARGIN,
           predicted: dict[str, float] | None = None) -> str:
    """The candidate to keep among those measured within `margin` of the fastest (a few steps cannot
    tell them apart), a lossless one if there is one (vgg's plan, blocktopk on one layer, ran 2094 ms
    against 2110 for the planner without compression (SFB for every layer), at a loss 2.4% above
    DDP's after 6 steps: speed alone kept it). Of those, the one `predicted` (each candidate's
    predicted step) ranks fastest if it puts every other more than `margin` behind: ncf's trial
    measured uniform blocktopk 51 ms and the planner without the collective choice 52; four rounds then
    ran the second 3-8% faster in each, as the model had ranked them (42.0 against 44.5 ms predicted):
    within the margin the measurement is noise and the model is not. Where the model sees some of them
    level too, the fastest measured of those: on ncf with sparse embeddings the plan (its MLP on the
    ring beside the embeddings' sparse AllReduce) was predicted 1.3% faster than uniform sparse and
    measured 0.6-5.4% slower in three trials, 3-7% in rounds of 60 steps."""
    best = min(step_s.values())
    near = [name for name in step_s if step_s[name] <= best * (1 + margin)]
    pool = [name for name in near if name in lossless_ones] or near
    ranked = predicted or dict.fromkeys(pool, 0.0)
    first = min(ranked[name] for name in pool)
    level = [name for name in pool if ranked[name] <= first * (1 + margin)]
    return min(level, key=step_s.get)


def fits_interleaved(parameters: int, candidates: int, workers: int, available: int | None = None) -> bool:
    """Whether `candidates` models of `parameters` each, in each of `workers` processes, fit in
    MEMORY_SHARE of the memory available to new processes (by default this machine's now; none if
    unknown)."""
    available = (meminfo("MemAvailable") or 0) if available is None else available
    return workers * candidates * parameters * BYTES_PER_PARAMETER <= MEMORY_SHARE * available


def fresh_memory(events: list[dict]) -> set:
    """The steps (numbers) in which some worker took fresh memory (bench.memory)."""
    return {e.get("step") for e in events if took_fresh_memory(e.get("page_faults", 0))}


def step_time(events: list[dict], left_out: set | None = None) -> float:
    """A candidate's step from its timed step events: the mean over those not `left_out` (by
    default its own steps that took fresh memory), if any are left; all of them otherwise. A step
    that grows the heap (deeplight's 68 MB embedding gradient: 16,533 pages, 260-410 ms against
    100-160) falls on 0-3 of a mode's 53 interleaved steps, whichever mode: one in a trial's 16 made
    its mean 15% longer. Interleaved, the steps left out are those in which any candidate took fresh
    memory, for every candidate alike: leaving out only a candidate's own would also leave out its
    share of a slow patch of the machine that the others keep."""
    left_out = fresh_memory(events) if left_out is None else left_out
    kept = [e for e in events if e.get("step") not in left_out]
    return statistics.fmean(e["step_s"] for e in (kept or events))


def train(config: dict, name: str, workers: int, network: str, steps: int, warmup: int, timeout: float,
          advance: Callable[..., None]) -> list[dict]:
    """The timed step events (the workers' mean step, as `sparcoll train` reports them) of one training
    job of `warmup` untimed and `steps` more (command.timed_steps: the probed ones are left out);
    BenchError if it fails."""
    events: list[dict] = []

    def on_event(event: dict) -> None:
        if event.get("event") == "step":
            events.append(event)
            advance(f"trial {name}: step {len(events)}")
        elif event.get("event") == "restart":       # the steps so far are of a run that crashed
            advance(f"trial {name}: crashed in native code, again", more=len(events) + 1)
            events.clear()

    try:
        launch({**config, "steps": warmup + steps}, workers, network, timeout, on_event)
        if len(events) != warmup + steps:
            raise BenchError(f"it reported {len(events)} of {warmup + steps} steps")
    finally:
        for _ in range(warmup + steps - len(events)):
            advance(f"trial {name}: failed")
    return timed_steps(events, warmup)


def interleaved(config: dict, plans: dict[str, dict], workers: int, network: str, steps: int, warmup: int,
                timeout: float, advance: Callable[..., None]) -> dict[str, list[dict]]:
    """Each plan's timed step events in one job that trains them all, a step of each in turn
    (`sparcoll train --interleave`: the same shuffled order on every worker), steps_of(plan, steps) of
    the longest of them each after `warmup`; BenchError if it fails."""
    names = list(plans)
    n = max(steps_of(plan, steps) for plan in plans.values())
    events: dict[str, list[dict]] = {name: [] for name in names}

    def on_event(event: dict) -> None:
        if event.get("event") == "step":
            name = names[event.get("mode", 0)]
            events[name].append(event)
            advance(f"trial, interleaved: {name}: step {len(events[name])}")

    job = {**config, "comm": None, "steps": warmup + n,
           "modes": [{"comm": PLANNED, "compress": None, "strategy": plan} for plan in plans.values()]}
    try:
        launch(job, workers, network, timeout, on_event)
        short = [name for name in names if len(events[name]) != warmup + n]
        if short:
            raise BenchError(f"{short[0]} reported {len(events[short[0]])} of {warmup + n} steps")
    finally:
        for _ in range(len(names) * (warmup + n) - sum(map(len, events.values()))):
            advance("trial, interleaved: failed")
    return {name: timed_steps(events[name], warmup) for name in names}


def measure(config: dict, plans: dict[str, dict], workers: int, network: str, steps: int, warmup: int,
            timeout: float, advance: Callable[..., None], ddp_steps: int = 0,
            passes: int = PASSES, interleave: bool = False) -> Measured:
    """Each plan's step time, trained by sparcoll.torch.DataParallel as `sparcoll train --comm planned`
    does, for steps_of(plan, steps) steps after `warmup` untimed ones, one job after another; with
    `ddp_steps`, DDP on gloo too (the reference, last in the order: not a candidate, DataParallel cannot
    run it; with sparse embeddings DDP's gathers of their rows are fast, and on deeplight every plan was
    slower than it, 0.88-0.90x, which a plan compared with its own alternatives alone never shows). Every job runs `passes` times, the
    order reversed on every other pass, and its time is the mean over its passes: on this shared
    machine whole launches ran 20-25% slower than others minutes apart (ncf with sparse embeddings, the
    same plan six times: 29.6-37.5 ms), so a candidate measured once, early or late, could win or lose
    by that alone; in reversed passes a drift falls on every candidate alike. A job that fails is left
    out with its reason (one strategy that cannot run here must not cost the user the others).
    `interleave`: each pass trains the plans in one job (`interleaved`), where a drift of the machine
    falls on all of them alike: at 42832d4 a slow patch fell on both of deeplight's separate runs of
    the planner's decision (129-139 ms), and the trial kept uniform sparse (122-130), which the rounds
    and six rounds of separate jobs since measured 1.07-1.31x slower. If such a job fails, every
    plan trains in jobs of its own instead, so that the one that failed is left out alone."""
    if interleave and len(plans) > 1:
        try:
            return _measure_interleaved(config, plans, workers, network, steps, warmup, timeout, advance,
                                        ddp_steps, passes)
        except BenchError as exc:
            advance(f"trial: the interleaved job failed ({exc}); each candidate in jobs of its own",
                    more=passes * (sum(warmup + steps_of(plan, steps) for plan in plans.values())
                                   + (warmup + ddp_steps if ddp_steps else 0)))
    jobs = {name: ({**config, "comm": PLANNED, "compress": None, "strategy": plan}, steps_of(plan, steps))
            for name, plan in plans.items()}
    if ddp_steps:
        jobs[DDP] = (_ddp_job(config), ddp_steps)
    means: dict[str, list[float]] = {name: [] for name in jobs}
    shares: list[float] = []
    failed: dict[str, str] = {}
    for number in range(passes):
        for name in (list(jobs) if number % 2 == 0 else reversed(list(jobs))):
            job, job_steps = jobs[name]
            _train_into(means, shares, failed, job, name, workers, network, job_steps, warmup, timeout,
                        advance)
    step_s = {name: statistics.fmean(means[name]) for name in plans if name not in failed}
    if not step_s:
        raise BenchError("every candidate of the trial failed: " + "; ".join(
            f"{n}: {r}" for n, r in failed.items() if n != DDP))
    reference = _reference(ddp_steps, means, shares, failed)
    return Measured(step_s, failed, reference, {name: means[name] for name in step_s})


def _ddp_job(config: dict) -> dict:
    return {**config, "comm": "ddp", "compress": None, "strategy": None}


def _train_into(means: dict[str, list[float]], shares: list[float], failed: dict[str, str], job: dict,
                name: str, workers: int, network: str, steps: int, warmup: int, timeout: float,
                advance: Callable[..., None]) -> None:
    """One job of a candidate or of DDP (`name`), trained: its step time into means[name] (DDP's
    communication share into `shares` too), or its failure into `failed` (then it is not run again)."""
    if name in failed:
        for _ in range(warmup + steps):
            advance(f"trial {name}: failed")
        return
    try:
        events = train(job, name, workers, network, steps, warmup, timeout, advance)
    except BenchError as exc:
        failed[name] = str(exc)
        return
    if name == DDP:
        means[name].append(statistics.fmean(e["step_s"] for e in events))
        shares.append(statistics.fmean(e["comm_s"] for e in events) / means[name][-1])
    else:
        means[name].append(step_time(events))


def _reference(ddp_steps: int, means: dict[str, list[float]], shares: list[float],
               failed: dict[str, str]) -> dict:
    """DDP's reference for Measured (taken out of `failed`): nothing if not asked, its failure, or its
    step and communication share."""
    if not ddp_steps:
        return {}
    if DDP in failed:
        return {"failed": failed.pop(DDP)}
    return {"step_s": statistics.fmean(means[DDP]), "comm_share": statistics.fmean(shares)}


def _measure_interleaved(config: dict, plans: dict[str, dict], workers: int, network: str, steps: int,
                         warmup: int, timeout: float, advance: Callable[..., None], ddp_steps: int,
                         passes: int) -> Measured:
    """measure, the plans interleaved in one job per pass, DDP's reference in a job of its own after
    it (reversed on every other pass)."""
    means: dict[str, list[float]] = {name: [] for name in [*plans, DDP]}
    shares: list[float] = []
    failed: dict[str, str] = {}
    for number in range(passes):
        jobs = ["plans", DDP] if ddp_steps else ["plans"]
        for job in (jobs if number % 2 == 0 else reversed(jobs)):
            if job == DDP:
                _train_into(means, shares, failed, _ddp_job(config), DDP, workers, network, ddp_steps, warmup,
                            timeout, advance)
                continue
            events = interleaved(config, plans, workers, network, steps, warmup, timeout, advance)
            fresh = set().union(*map(fresh_memory, events.values()))
            for name, timed in events.items():
                means[name].append(step_time(timed, fresh))
    reference = _reference(ddp_steps, means, shares, failed)
    return Measured({name: statistics.fmean(means[name]) for name in plans}, {}, reference,
                    {name: means[name] for name in plans})
