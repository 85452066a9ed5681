"""`sparcoll plan`: a strategy per tensor for a model on this machine and network (ByteComp's planner).

    sudo sparcoll plan --workload ncf --workers 4 --network 1gbit --json plan.json
    sparcoll plan --model mypackage.models:build --workers 4 --network none --json plan.json
    sparcoll train --workload ncf --comm planned --plan plan.json

The profile (profiler.py: the model's backward timeline under load, compressors' and collectives' times,
measured by a job of --workers processes on the --network, emulated or loopback) is written to
--profile and reused by later runs that ask for the same model, workers, network, link burst, block
size and compressors (--reprofile measures again; a stored profile the plan cannot read is refused, naming
why). The decision (decide.plan) then prints a per-tensor table and the predicted step time F against
every uniform strategy and a free-communication bound, and writes the plan as JSON (what it holds
for, which `sparcoll train --comm planned` checks: `workers`, `network`, `link_burst`, `block_size`,
the workload's or --model's; `decision_ms`, `predicted_step_s`: forward, backward, synchronization and
optimizer, as `sparcoll train` measures a step; `cpu_bound_s`, the least the workers' CPU allows, and
`idle_s`, how long the cores stand idle in the step while every worker waits; `uniform`, `dense_only`
(dense_only_of), `bound_s`, `tensors`: one entry per tensor in backward order, with the strategy
sparcoll.torch.DataParallel executes and its unit's predicted times from backward's start; `unused`:
the parameters left out, as backward gives them no gradient, which DataParallel lets stay out).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

from sparcoll.bench.launch import Job, run_job, run_jobs
from sparcoll.bench.netem import add_link_burst_argument, check_network, parse_rate
from sparcoll.compress import parse
from sparcoll.options import env_block_size
from sparcoll.outputs import check_output_path
from sparcoll.train import command as train_command
from sparcoll.train.command import BATCH_SIZES, _option, check_builds, workload_options
from sparcoll.workloads import WORKLOADS, user

from . import decide, fusion, trial
from sparcoll.torch.parallel import BUCKET_BYTES, SMALL_BYTES

from .costs import ITEMSIZE, Costing, Measured, in_sequence
from .options import ALL_COMPRESSORS, COMPRESSORS, DEDICATED, PS, RING, SFB, SPARSE, JobFacts, Option, TensorFacts, options
from .profiler import averaged_windows, cores_each, events_after_model, fit
from .stored import differing, invalid, stored_profile
from .timeline import Cost, Step, simulate

# A stored profile of another version is measured anew. What each version changed (10 was also the
# reverted 5362592's): 12 PowerSGD 2-4x faster (ac39baa); 13 COO gradients measured whole; 14 the
# sparse AllReduce's points carry their elements; 15 units of COO gradients timed as one collective;
# 16 the sparse scheme's decompression into the gradient; 17 every decompression into the gradient
# (allgather: combined there); 18 the slowdown of the steps' work while the collectives ran, for at
# least a step; 19 every worker keeps freed memory (sparcoll.keep_freed_memory): backward allocates
# no large gradient afresh; 20 a compressor's time on the model's gradient is measured inside
# backward, where a plan runs it; 21 SFB's spared work is measured in backward, its rebuild beside
# training too; 22 the backward timeline warms up until its pages have settled; (23 was a warm-up of
# the compressors' steps in backward, reverted) 24 the compressors' steps in backward timed as many as
# fit in a few seconds; 25 the workers start with glibc's thread cache and fastbins off, so a freed
# large gradient serves the next (allocator): no worker faults one in at a random iteration; 26 the
# COO gradients timed together whatever is ready between them (fusion.coo_units); 27 how long a small
# ring delays a sparse AllReduce started right after it (profiler.held_beside); 28 the CPU of each
# time alone and of a training step (timeline.Step.cpu_bound); (29 was the workers' mean CPU, not
# kept) 30 a compressor's CPU on the model's gradient measured inside backward too, and every curve
# measured at the model's whole gradient, not extended to it from below (profiler.Sizes); 31 a
# sparse-scheme compressor's payload priced as the COO tensor of blocks it travels as (costs.BLOCKS),
# not as a dense tensor of the gradient's size, whose scan it does not do; 32 the CPU as the workers'
# mean (profiler.slowest_and_mean), and every dense gradient's compressor timed inside backward, its
# decompression too (the profiles of docs/results/plan-292cd77-idle and plan-0de37c5-fresh, measured
# so, still say 31); 33 each collective's CPU beside training too (profiler.under_load); 34 that CPU
# without its inputs' preparation (33 counted the copy of each run's input: the sparse AllReduce of ncf's
# and deeplight's dense gradients 1.6-1.7x its CPU alone, docs/results/plan-d083989-fresh); 36 no batch's
# making timed (profiler.model_and_loss; 35 was tried and reverted, docs/results/profile-speed-median);
# 37 the backward timeline and a step's CPU the mean of windows spread over the profile (averaged_windows);
# 38 an embedding declared dense timed under the sparse AllReduce as DataParallel sends it: its rows as COO;
# 39 its sum written into a table kept from run to run, as DataParallel now does (KeptTables), not to_dense;
# 40 the backward work its rows looked up sparse spare (profiler.spared_by_lookups).
PROFILE_VERSION = 40
UNIFORM_COLLECTIVES = (RING, PS, SPARSE, SFB)
DIMENSIONS = ("compression", "collective", "offload")
GREEDY, WHOLE = "greedy", "whole"       # fusion: one join at a time while predicted no slower; all at once
TRIAL_UNIFORMS = 3
TRIAL_STEPS = 3         # --trial's default
DENSE_ONLY = "for dense gradients"      # a compressor's strategy on the dense gradients only (dense_only_of)
TRIAL_WARMUP = 1


def _compressors(text: str) -> list[str]:
    """--compressors: specs separated by commas (an option such as ef=off continues the spec before
    it, as in `sparcoll train --compress`), or "all": every family of options.ALL_COMPRESSORS,
    convergence aside. Each spec is checked here, before the profile's minutes; no compression ("none")
    is always among the options: it is every tensor's starting point (decide.uncompressed) and the
    ring's and the sparse AllReduce's."""
    if text.strip().lower() == "all":
        return list(ALL_COMPRESSORS)
    specs: list[str] = []
    for piece in (piece.strip() for piece in text.split(",") if piece.strip()):
        if specs and "=" in piece and ":" not in piece.partition("=")[0]:
            specs[-1] += f",{piece}"
        else:
            specs.append(piece)
    for spec in specs:
        try:
            parse(spec)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return list(dict.fromkeys(["none", *specs]))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group()
    # no default here: argparse lets a value equal to the default pass beside --model (identity() has it)
    what.add_argument("--workload", choices=list(WORKLOADS), help="default ncf")
    what.add_argument("--model", metavar="MODULE:FUNCTION",
                      help="your own model: FUNCTION() returns (nn.Module, example input of one worker); "
                           "the loss is the output if it is a scalar, else a returned dict's scalar 'loss', "
                           "else the sum of the output's floating-point tensors")
    parser.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument("--network", default="1gbit", type=lambda text: text.strip().lower(),
                        help="link rate of the emulated network (needs root), or none: loopback "
                             "(default 1gbit)")
    add_link_burst_argument(parser)
    parser.add_argument("--batch-size", type=int, default=None,
                        help="samples per worker (default as sparcoll train's)")
    parser.add_argument("--workload-option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                        help="a field of the workload's config, as for sparcoll train; repeatable")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compressors", default=",".join(COMPRESSORS), type=_compressors,
                        help="compressor specs to choose from besides no compression, comma separated, "
                             "or all (default: the "
                             "families that kept the loss within 5%% of DDP's in our convergence runs: "
                             + ",".join(COMPRESSORS) + ")")
    parser.add_argument("--profile", metavar="PATH", default="sparcoll-profile.json",
                        help="profile file: reused when it matches, else measured and written there "
                             "(default sparcoll-profile.json)")
    parser.add_argument("--reprofile", action="store_true", help="measure the profile again")
    parser.add_argument("--without", action="append", default=[], choices=DIMENSIONS,
                        help="decide without this dimension (the ablation): compression, collective "
                             "or offload; repeatable")
    parser.add_argument("--uniform", metavar="NAME",
                        help="write the uniform strategy NAME (a row of the table: ring, ps, sparse, sfb or "
                             "a compressor spec) instead of the decision, to run it with the same executor")
    parser.add_argument("--dense-only", action="store_true",
                        help="with --uniform a compressor: that compressor on the dense gradients only, the "
                             "sparse (COO) ones on their cheapest uncompressed collective (a row 'dense "
                             "tensors' of the table)")
    parser.add_argument("--trial", type=int, default=None, metavar="STEPS",
                        help="train the plan, the planner without each dimension, the %d uniform "
                             "strategies predicted best and the best predicted lossless one (and, for a "
                             "model with sparse gradients, the 'dense tensors' strategy predicted best), "
                             "and the plan and the best of those "
                             "fused the other way (--fusion), for at least STEPS steps and %g s each (after one warm-up) on the "
                             "same network, and keep the fastest measured (of those within %d%%%% of it, "
                             "a lossless one, and of those the one predicted fastest if predicted that much "
                             "ahead of the others, else the fastest); 0: the model's decision alone (default %d; a "
                             "--model trains on its example input; not with --uniform or --without)"
                             % (TRIAL_UNIFORMS, trial.SECONDS, round(100 * trial.MARGIN), TRIAL_STEPS))
    parser.add_argument("--trial-passes", type=int, default=trial.PASSES, metavar="N",
                        help="train every candidate of the trial N times, every other pass in reversed "
                             "order, and keep by the mean (default %d: a machine that slows down or speeds "
                             "up during the trial then favours no candidate; 1 takes half the time)"
                             % trial.PASSES)
    parser.add_argument("--trial-jobs", choices=("auto", "interleaved", "separate"), default="auto",
                        help="interleaved: each pass trains every candidate in one job, a step of each in "
                             "turn (a slow patch of the machine then falls on all alike); separate: each in "
                             "a job of its own; auto (default): interleaved where every candidate's model "
                             "fits in half the memory available in every worker at once")
    parser.add_argument("--fusion", choices=(GREEDY, WHOLE), default=GREEDY,
                        help="how tensors of one compressor (or uncompressed on the ring) share a "
                             "collective: greedy, one more while the model predicts no slower a step "
                             "(default); whole, all of them in one collective. The "
                             "trial also trains the plan and the best uniform strategy fused the other way")
    parser.add_argument("--json", metavar="PATH", help="write the plan to PATH")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds without progress before profiling is declared hung (default 600)")


def identity(args) -> dict:
    """What a profile was measured for: a stored profile is reused only for the same. A --model is
    built here (user.checked_here: a model the workers would refuse is a ValueError) and known by its
    fingerprint too: edited under the same MODULE:FUNCTION, it is measured again."""
    if args.model:
        model = {"model_spec": args.model, "fingerprint": user.fingerprint(user.checked_here(args.model))}
    else:
        workload = args.workload or "ncf"
        options = workload_options(workload, args.workload_option)
        check_builds(workload, options, args.workload_option)
        model = {"workload": workload, "options": options,
                 "batch_size": args.batch_size or BATCH_SIZES.get(workload, 256), "seed": args.seed}
    return {"version": PROFILE_VERSION, "workers": args.workers, "network": args.network,
            "link_burst": args.link_burst, "block_size": env_block_size(), "compressors": sorted(args.compressors),
            **model}


def measure(ident: dict, timeout: float) -> dict:
    """Run the profiling job; the profile (identity, the model's measurements, the points, fits)."""
    model, points, windows = {}, [], []

    def body(advance) -> None:
        def on_event(event: dict) -> None:
            if event["event"] == "model":
                model.update({k: v for k, v in event.items() if k != "event"})
                advance("model timeline", events_after_model(ident, model))
            elif event["event"] == "point":
                points.append({k: v for k, v in event.items() if k != "event"})
                advance(f"{event['kind']} {event['what']}")
            elif event["event"] == "window":
                windows.append({k: v for k, v in event.items() if k != "event"})
                advance("timeline window")
            elif event["event"] == "speed":
                model["reference_cpu_s"] = event["reference_cpu_s"]
        run_job(Job(ident["workers"], ident["network"], 0, {**ident, "timeout": timeout},
                    timeout, worker="sparcoll.plan.profiler", link_burst=ident["link_burst"]), on_event)

    status = run_jobs("plan --profile", 1, body)
    if status:
        raise RuntimeError(f"profiling failed (exit status {status})")
    return {**ident, "model": averaged_windows(model, windows), "points": points, "fits": fit(points)}


def load_or_measure(args, ident: dict) -> dict:
    """The stored profile at --profile if it was measured for `ident` (identity), else a new one
    written there; a ValueError if the stored one of that identity is not a valid profile."""
    path = Path(args.profile)
    stored = stored_profile(path)
    if stored is not None and not args.reprofile:
        differ = differing(stored, ident)
        if not differ:
            problem = invalid(stored)
            if problem:
                raise ValueError(f"{path} is not a valid sparcoll profile: {problem}; run with --reprofile")
            cores = cores_each(ident["workers"])     # its workers run on this host
            if not math.isclose(stored["model"]["cores_per_worker"], cores):
                print(f"sparcoll plan: {path} was measured with {stored['model']['cores_per_worker']:g} cores per "
                      f"worker, this machine has {cores:g}: another machine's? its times may not hold here "
                      f"(--reprofile measures them again)", file=sys.stderr)
            return stored
        print(f"sparcoll plan: {path} was measured for {', '.join(differ)}; measuring again", file=sys.stderr)
    profile = measure(ident, args.timeout)
    path.write_text(json.dumps(profile, indent=1, allow_nan=False))
    return profile


def tensors_of(profile: dict) -> tuple[Step, list[Measured]]:
    """The profiled model's Step and tensors, in backward order."""
    m = profile["model"]
    measured = []
    for name in m["order"]:
        t = m["tensors"][name]
        measured.append(Measured(TensorFacts(name, t["numel"], t["linear"] and t["rows"] > 0, t["coo"]),
                                 tuple(t["shape"]), t["rows"], t["density"], t["union"],
                                 *(t.get(k, 0.0) for k in ("node", "spared", "rebuild")),
                                 t.get("rebuild_loaded"), t.get("rebuild_slowdown", 1.0), t.get("rebuild_cpu", 0.0),
                                 t.get("rebuild_cpu_loaded"), t.get("lookup_spared", 0.0),
                                 t.get("lookup_spared_cpu", 0.0)))
    return Step(tuple(m["ready"]), m["backward_end"], m["optimizer"], m.get("cpu", 0.0),
                m["cores_per_worker"] if "cpu" in m else 0.0, m["forward"]), measured


def units_of(step: Step, measured: list[Measured]) -> tuple[Step, list[Measured], list[list[int]]]:
    """The units the plan chooses for: each tensor, except that consecutive small dense ones form a
    group as sparcoll.torch.DataParallel's buckets do (up to BUCKET_BYTES, in ready order), one
    option for the group; and a linear layer's weight that SFB can serve takes its bias, which
    backward produces just before it, into its unit: under SFB the factors carry the bias
    (DataParallel sends nothing for it) and are ready at the layer's output gradient, before the
    bias. A unit of several tensors travels as DataParallel sends a plan's unit: on the ring as one
    allreduce, under a compressor as one collective of their payloads, under the sparse AllReduce as
    one collective if they hold at most BUCKET_BYTES, else one by one, as under the parameter server
    (choices_of). A unit is ready with its last member. Returns the
    units' Step, the units, their members."""
    groups: list[list[int]] = []
    open_group: list[int] = []
    for i, t in enumerate(measured):
        small = not t.facts.coo and t.facts.numel * ITEMSIZE <= SMALL_BYTES
        if not small:
            bias = _own_bias(measured, i)
            if bias is not None and open_group and open_group[-1] == bias:
                open_group.pop()
            elif bias is not None and groups and groups[-1][-1] == bias:    # it closed a bucket
                groups[-1].pop()
                if not groups[-1]:
                    groups.pop()
            if open_group:
                groups.append(open_group)
                open_group = []
            groups.append([i] if bias is None else [bias, i])
            continue
        open_group.append(i)
        if sum(measured[j].facts.numel for j in open_group) * ITEMSIZE >= BUCKET_BYTES:
            groups.append(open_group)
            open_group = []
    if open_group:
        groups.append(open_group)
    units = [_unit(measured, g) for g in groups]
    return replace(step, ready=tuple(step.ready[g[-1]] for g in groups)), units, groups


def bias_of(weight: str) -> str | None:
    """The name of the bias beside a layer's weight (module.weight -> module.bias)."""
    return weight[:-len("weight")] + "bias" if weight.endswith(".weight") else None


def _own_bias(measured: list[Measured], i: int) -> int | None:
    """The index of weight i's bias if i is a linear layer's weight SFB can serve and its bias came
    just before it in backward, else None."""
    if i and measured[i].facts.linear and measured[i - 1].facts.name == bias_of(measured[i].facts.name):
        return i - 1
    return None


def _is_layer(measured: list[Measured], members: list[int]) -> bool:
    return len(members) == 2 and _own_bias(measured, members[1]) == members[0]


def _unit(measured: list[Measured], members: list[int]) -> Measured:
    """What a unit is to the options and costs: a tensor alone; a layer, as its weight (SFB's facts)
    with the bias's elements; a bucket, its members' elements and their average densities."""
    if len(members) == 1:
        return measured[members[0]]
    if _is_layer(measured, members):
        bias, weight = (measured[i] for i in members)
        facts = replace(weight.facts, name=f"{bias.facts.name}+{weight.facts.name}",
                        numel=bias.facts.numel + weight.facts.numel)
        return replace(weight, facts=facts)
    group = [measured[i] for i in members]
    numel = sum(t.facts.numel for t in group)
    density, union = (sum(getattr(t, k) * t.facts.numel for t in group) / numel for k in ("density", "union"))
    return Measured(TensorFacts("+".join(t.facts.name for t in group), numel), (numel,), 0, density, union)


def choices_of(units: list[Measured], groups: list[list[int]], measured: list[Measured], costing: Costing,
               compressors, job: JobFacts) -> list[decide.Choices]:
    """Each unit's valid options and their costs, as sparcoll.torch.DataParallel sends a group: on the
    ring a bucket or a layer as one allreduce; under a compressor each
    member compressed, their payloads in one collective; under SFB the weight's factors carry its
    bias; under the sparse AllReduce uncompressed as one collective if they hold at most BUCKET_BYTES
    (concatenated); under any other option one by one."""
    out = []
    for unit, members in zip(units, groups):
        costs = {}
        concatenated = unit.facts.numel * ITEMSIZE <= BUCKET_BYTES
        for o in options(unit.facts, job, compressors):
            if len(members) == 1 or o == Option() or (concatenated and o.uncompressed_sparse):
                costs[o] = costing.cost(unit, o)
            elif o.collective == SFB:
                costs[o] = costing.cost(measured[members[-1]], o)
            elif o.compressor != "none":
                costs[o] = costing.bucket([measured[i] for i in members], o)
            else:
                costs[o] = in_sequence([costing.cost(measured[i], o) for i in members], o.offload)
        out.append(decide.Choices(unit.facts.name, unit.facts.numel, costs))
    return out


def uniform(tensors: list[decide.Choices], compressor: str, collective: str | None,
            skipped: list[bool] | None = None) -> list[Option] | None:
    """Every tensor the same option where it is valid (SFB: linear layers; a compressor: by its
    carrier) and not `skipped`, the others their cheapest uncompressed one; None if no tensor can
    take it."""
    out, used = [], False
    for i, t in enumerate(tensors):
        fits = [o for o in t.costs if o.compressor == compressor and not o.offload
                and (collective is None or o.collective == collective) and not (skipped and skipped[i])]
        out.append(fits[0] if fits else decide.uncompressed(t))
        used = used or bool(fits)
    return out if used else None


def dense_only_of(tensors: list[decide.Choices], coo: list[bool], compressors,
                  uniforms: dict[str, list[Option]]) -> dict[str, list[Option]]:
    """For a model with sparse COO gradients: each compressor on the dense gradients only, the COO
    ones on their cheapest uncompressed collective (a recommendation model's usual split: its
    embeddings' rows travel as they are, its MLP compressed), where that differs from the uniform
    strategy. A candidate of the trial beside the uniform strategies: the decision prices each
    collective apart, and on deeplight with sparse embeddings its mix of six collectives ran 22-25%
    slower than predicted where this split ran within 3% in two trials (docs/benchmarks-log.md, section 7)."""
    out = {}
    for compressor in compressors:
        strategy = uniform(tensors, compressor, None, coo) if compressor != "none" else None
        if strategy is not None and strategy != uniforms.get(compressor):
            out[compressor] = strategy
    return out


def free(t: decide.Choices) -> Cost:
    """The unit with free communication: nothing on the channel, and as little backward work as any
    of its options leaves (SFB spares the local weight gradient)."""
    return Cost(compress=min(0.0, *(c.compress for c in t.costs.values())))


def strategy_of(option: Option) -> str:
    """What sparcoll.torch.DataParallel calls the option (its placement is separate)."""
    if option.compressor != "none":
        return option.compressor
    return "sparse" if option.collective == DEDICATED else option.collective


def without(tensors: list[decide.Choices], dimensions) -> list[decide.Choices]:
    """The planner with dimensions removed (ByteComp's ablation): "compression" (uncompressed only),
    "collective" (an uncompressed tensor on the ring; a compressed one's carrier is its
    compressor's, no choice), "offload" (compression on the training thread only)."""
    def kept(o: Option) -> bool:
        return not (("compression" in dimensions and o.compressor != "none")
                    or ("collective" in dimensions and o.compressor == "none" and o.collective != RING)
                    or ("offload" in dimensions and o.offload))
    return [decide.Choices(t.name, t.numel, {o: c for o, c in t.costs.items() if kept(o)}) for t in tensors]


def uniforms_of(step: Step, tensors: list[decide.Choices], compressors) -> dict[str, list[Option]]:
    """Every uniform strategy by name: an uncompressed collective's name, or a compressor spec."""
    out = {}
    for compressor in compressors:
        for collective in (UNIFORM_COLLECTIVES if compressor == "none" else (None,)):
            strategy = uniform(tensors, compressor, collective)
            if strategy is not None:
                out[collective if compressor == "none" else compressor] = strategy
    return out


def costing_of(profile: dict) -> Costing:
    """The profile's cost models, on its network's links (loopback: none)."""
    network = profile["network"]
    return Costing(profile["fits"], profile["workers"], None if network == "none" else parse_rate(network) / 8)


def priced(profile: dict, compressors: list[str]):
    """A profiled model's units as the plan chooses for them: the units' Step, the tensors, each
    unit's members, its Choices over `compressors`, and the Costing that priced them."""
    step, measured = tensors_of(profile)
    step, units, groups = units_of(step, measured)
    job = JobFacts(offload_core=profile["model"]["cores_per_worker"] >= 2)
    costing = costing_of(profile)
    return step, measured, groups, choices_of(units, groups, measured, costing, compressors, job), costing


def priced_as_stored(profile: dict, plan: dict):
    """A stored plan's units priced by `profile` (another profile of the same model may price it,
    benchmarks/contention_predict.py): the units' Step, Choices and the plan's option of each."""
    step, measured, groups, tensors, costing = priced(profile, list(profile["compressors"]))
    by_name = {t["name"]: t for t in plan["tensors"]}
    chosen = [next(o for o in t.costs if str(o) == by_name[measured[g[-1]].facts.name]["option"])
              for g, t in zip(groups, tensors)]
    return fusion.as_planned(step, measured, groups, tensors, chosen, costing,
                             {name: t["unit"] for name, t in by_name.items()})


def why_none(fixed: str, compressors: list[str], dense_only: bool, has_coo: bool, uniforms: dict) -> str:
    """Why the model has no uniform (or dense-only) strategy `fixed`."""
    if fixed not in UNIFORM_COLLECTIVES and fixed not in compressors:
        return "not among --compressors"
    if dense_only and not has_coo:
        return "the model has no sparse (COO) gradient to leave uncompressed"
    if dense_only and fixed in uniforms:
        return f"it is --uniform {fixed} here (which leaves the sparse gradients uncompressed already)"
    if fixed == SFB:
        return (f"SFB takes the weight of a linear layer that travels alone (larger than {SMALL_BYTES >> 10} KB; "
                f"smaller gradients share buckets), and this model has none")
    return "no tensor of this model can take it"


def make_plan(profile: dict, compressors: list[str], dimensions=(), fixed: str | None = None,
              fused_by: str = GREEDY, dense_only: bool = False) -> dict:
    """The plan for a profile: the decision over `compressors` without `dimensions` (see `without`),
    or with `fixed` the uniform strategy of that name (with `dense_only`, that compressor on the
    dense gradients only: dense_only_of), its units fused `fused_by` (GREEDY or WHOLE, see fusion);
    with every uniform and dense-only strategy's prediction, fused the same way."""
    step, measured, groups, tensors, costing = priced(profile, compressors)
    uniforms = uniforms_of(step, tensors, compressors)
    coo = [all(measured[i].facts.coo for i in members) for members in groups]
    dense_onlies = dense_only_of(tensors, coo, compressors, uniforms)
    joins = fusion.whole_runs if fused_by == WHOLE else None

    def fused(strategy: list[Option]):
        return fusion.fuse(step, measured, groups, tensors, strategy, costing, joins)

    def predicted(units: tuple) -> float:
        """F of fusion.fuse's result."""
        unit_step, _, unit_tensors, unit_chosen = units
        return decide.predict(unit_step, unit_tensors, unit_chosen)

    start = time.perf_counter()
    if fixed is not None:
        named = dense_onlies if dense_only else uniforms
        if fixed not in named:
            raise ValueError(f"no {'dense-only' if dense_only else 'uniform'} strategy {fixed!r}: "
                             f"{why_none(fixed, compressors, dense_only, any(coo), uniforms)}; there are "
                             f"{', '.join(named) or 'none'}")
        chosen = named[fixed]
    else:
        allowed = without(tensors, dimensions)
        chosen = decide.plan(step, allowed)
    units = fused(chosen)
    decision_ms = 1e3 * (time.perf_counter() - start)
    if fixed is None:   # the searches price operations alone and units apart: a uniform may predict less
        others = uniforms_of(step, allowed, compressors).values() if dimensions \
            else [*uniforms.values(), *dense_onlies.values()]
        units = min([units, *map(fused, others)], key=predicted)
    unit_step, unit_groups, unit_tensors, unit_chosen = units
    costs = [t.costs[o] for t, o in zip(unit_tensors, unit_chosen)]
    timeline = simulate(unit_step, costs)
    entries = []
    for unit, (members, o, c, s, e) in enumerate(zip(unit_groups, unit_chosen, costs, timeline.comm_start,
                                                     timeline.comm_end)):
        for i in members:
            entries.append({"name": measured[i].facts.name, "numel": measured[i].facts.numel, "unit": unit,
                            "ready_s": profile["model"]["ready"][i], "strategy": strategy_of(o),
                            "placement": "offload" if o.offload else "thread", "option": str(o),
                            "unit_compress_s": c.compress, "unit_comm_s": c.comm,
                            "unit_decompress_s": c.decompress, "unit_comm_start_s": s, "unit_comm_end_s": e})
    forward = profile["model"]["forward"]
    # what the plan holds for, which sparcoll train checks: a profile measured before block_size was has none
    return {"workers": profile["workers"], "network": profile["network"],
            **{k: profile[k] for k in ("link_burst", "workload", "options", "batch_size", "model_spec")
               if k in profile},
            **({"block_size": profile["model"]["block_size"]} if "block_size" in profile["model"] else {}),
            "strategy": (f"{fixed} {DENSE_ONLY}" if dense_only else f"uniform {fixed}") if fixed
            else "planned",
            "without": sorted(dimensions), "fusion": fused_by,
            "decision_ms": decision_ms, "units": len(unit_tensors), "predicted_step_s": forward + timeline.iteration,
            "bound_s": forward + simulate(step, [free(t) for t in tensors]).iteration, "forward_s": forward,
            "cpu_bound_s": forward + unit_step.cpu_bound(costs) if unit_step.cores > 0 else None,
            "idle_s": timeline.idle,
            "cores_per_worker": profile["model"]["cores_per_worker"],
            "reference_cpu_s": profile["model"].get("reference_cpu_s"),
            "unused": profile["model"].get("unused", []),
            "uniform": {name: forward + predicted(fused(strategy)) for name, strategy in uniforms.items()},
            "dense_only": {name: forward + predicted(fused(strategy))
                           for name, strategy in dense_onlies.items()},
            "tensors": entries}


def table(plan: dict) -> str:
    """The plan per unit (a tensor, a layer, or tensors in one collective) and its predictions."""
    lines = [f"{'tensor (unit)':<44} {'numel':>10} {'ready ms':>9} {'option':<30} {'sync ms':>8}"]
    rows: dict[int, list[dict]] = {}
    for t in plan["tensors"]:
        rows.setdefault(t["unit"], []).append(t)
    for members in rows.values():
        t = members[-1]
        name = (t["name"] if len(members) == 1 else f"{t['name']} and its bias" if members[0]["name"] == bias_of(t["name"])
                else f"{len(members)} tensors ({members[0]['name']}...)")
        lines.append(f"{name[:44]:<44} {sum(m['numel'] for m in members):>10} {1e3 * t['ready_s']:>9.2f} "
                     f"{t['option'][:30]:<30} {1e3 * (t['unit_comm_s'] + t['unit_decompress_s']):>8.2f}")
    what = plan["strategy"] + (f" without {', '.join(plan['without'])}" if plan["without"] else "")
    lines.append(f"predicted step (forward, backward, synchronization, optimizer): "
                 f"{1e3 * plan['predicted_step_s']:.1f} ms {what}, {1e3 * plan['bound_s']:.1f} ms with "
                 f"free communication"
                 + (f", at least {1e3 * plan['cpu_bound_s']:.1f} ms by the workers' CPU"
                    + (f" and {1e3 * plan['idle_s']:.1f} more in which the cores stand idle" if plan.get("idle_s")
                       else "") if plan.get("cpu_bound_s") else "")
                 + f"; {len(plan['tensors'])} tensors in {plan['units']} units "
                 f"({plan.get('fusion', GREEDY)} fusion), decided in "
                 f"{plan['decision_ms']:.1f} ms")
    for name, f in sorted(plan["uniform"].items(), key=lambda kv: kv[1]):
        lines.append(f"  every tensor {name:<16} {1e3 * f:>10.1f} ms  ({f / plan['predicted_step_s']:.2f}x this plan)")
    for name, f in sorted(plan.get("dense_only", {}).items(), key=lambda kv: kv[1]):
        lines.append(f"  dense tensors {name:<15} {1e3 * f:>10.1f} ms  "
                     f"({f / plan['predicted_step_s']:.2f}x this plan; the sparse ones uncompressed)")
    if "trial" in plan:
        tr = plan["trial"]
        runs = len(tr.get("passes", {}).get(tr["kept"], ()))
        lines.append(f"trial (at least {tr['steps']} step{'s' * (tr['steps'] != 1)} and {trial.SECONDS:g} s each "
                     f"after {tr['warmup']} warm-up, trained on this network"
                     + (", interleaved step by step" if tr.get("interleaved") else "")
                     + (f", the mean of {runs} runs in alternating order" if runs > 1 else "")
                     + ", steps that took fresh memory left out" + f"), kept: {tr['kept']}")
        for name, s in sorted(tr["step_s"].items(), key=lambda kv: kv[1]):
            lines.append(f"  {name:<29} measured {1e3 * s:>10.1f} ms, predicted {1e3 * tr['predicted_step_s'][name]:.1f}"
                         + (", lossless" if name in tr.get("lossless", ()) else ""))
        for name, reason in tr.get("failed", {}).items():
            lines.append(f"  {name:<29} failed: {reason}")
        reference = tr.get("ddp", {})
        if "step_s" in reference:
            kept = tr["step_s"][tr["kept"]]
            lines.append(f"  {'DDP on gloo (the reference)':<29} measured {1e3 * reference['step_s']:>10.1f} ms, "
                         f"{100 * reference['comm_share']:.0f}% of it communicating: the plan kept is "
                         f"{reference['step_s'] / kept:.3f}x as fast")
            if reference["step_s"] < kept / (1 + trial.MARGIN):
                lines.append("  DDP on gloo was faster than the plan kept, beyond the trial's margin: keep DDP "
                             "for this model on this network")
        elif "failed" in reference:
            lines.append(f"  {'DDP on gloo (the reference)':<29} failed: {reference['failed']}")
    return "\n".join(lines)


def trial_others(plan: dict, profile: dict, compressors: list[str], fused_by: str) -> dict[str, dict]:
    """What the trial trains beside the plan, by name (trial.candidates drops those that execute as
    one before them): the planner without each dimension, the TRIAL_UNIFORMS uniform strategies
    predicted best and the lossless one predicted best, whatever its rank (with sparse embeddings the
    model put uniform sparse fourth on ncf, where it ran faster than every compressed one), the plan
    and the best uniform strategy fused the other way, and the best dense-only strategy."""
    others = {f"without {dim}": make_plan(profile, compressors, (dim,), fused_by=fused_by) for dim in DIMENSIONS}
    best = sorted(plan["uniform"], key=plan["uniform"].get)[:TRIAL_UNIFORMS]
    lossless = sorted((n for n in plan["uniform"] if n in UNIFORM_COLLECTIVES), key=plan["uniform"].get)[:1]
    best += [n for n in lossless if n not in best]
    for name in best:
        others[f"uniform {name}"] = make_plan(profile, compressors, fixed=name, fused_by=fused_by)
    other = WHOLE if fused_by == GREEDY else GREEDY     # the model cannot tell these apart (fusion.whole_runs)
    others[f"planned, {other} fusion"] = make_plan(profile, compressors, fused_by=other)
    for name in best[:1]:
        others[f"uniform {name}, {other} fusion"] = make_plan(profile, compressors, fixed=name, fused_by=other)
    for name in sorted(plan["dense_only"], key=plan["dense_only"].get)[:1]:
        others[f"{name} {DENSE_ONLY}"] = make_plan(profile, compressors, fixed=name, fused_by=fused_by,
                                                   dense_only=True)
    return others


def tried(plan: dict, profile: dict, args) -> tuple[int, dict]:
    """The trial (trial.py) of the plan against trial_others, trained as `sparcoll train` does by
    default; the exit status and the plan kept, with the trial's measurements."""
    plans = trial.candidates(plan, trial_others(plan, profile, args.compressors, args.fusion))
    defaults = vars(argparse_defaults(train_command.add_arguments))
    model = ({"model_spec": profile["model_spec"], "workload": None, "options": {}, "batch_size": None, "seed": 0,
              # DDP, the trial's reference, fails a model whose forward leaves a parameter unused without it
              "find_unused_parameters": bool(profile["model"].get("unused"))}
             if "model_spec" in profile else {k: profile[k] for k in ("workload", "options", "batch_size", "seed")})
    config = {**{k: defaults[k] for k in ("lr", "data")}, "timeout": args.timeout, "link_burst": args.link_burst,
              "block_size": plan.get("block_size", env_block_size()), **model}     # as the profile priced it
    steps_each = {name: trial.steps_of(p, args.trial) for name, p in plans.items()}
    ddp_steps = max(steps_each.values())
    parameters = sum(t["numel"] for t in profile["model"]["tensors"].values())
    interleave = args.trial_jobs == "interleaved" or (
        args.trial_jobs == "auto" and trial.fits_interleaved(parameters, len(plans), args.workers))
    if interleave:        # every candidate trains as many steps as the one that needs most
        steps_each = dict.fromkeys(steps_each, ddp_steps)
    measured: list[trial.Measured] = []

    def body(advance) -> None:
        measured.append(trial.measure(config, plans, args.workers, args.network, args.trial, TRIAL_WARMUP,
                                      args.timeout, advance, ddp_steps, args.trial_passes, interleave))

    status = run_jobs("plan --trial", args.trial_passes * sum(TRIAL_WARMUP + steps
                                                          for steps in [*steps_each.values(), ddp_steps]), body)
    if status:
        return status, plan
    step_s, failed, reference, passes = measured[0]
    for name, reason in failed.items():
        print(f"sparcoll plan: the trial of {name} failed and is left out: {reason}", file=sys.stderr)
    lossless = sorted(name for name in step_s if trial.lossless(plans[name]))
    kept = trial.choose(step_s, set(lossless), predicted={n: p["predicted_step_s"] for n, p in plans.items()})
    return 0, {**plans[kept], "decision_ms": plan["decision_ms"],
               "trial": {"steps": args.trial, "warmup": TRIAL_WARMUP, "margin": trial.MARGIN, "kept": kept,
                         "interleaved": interleave,
                         "steps_each": steps_each, "passes": passes,
                         "step_s": step_s, "lossless": lossless, "failed": failed,
                         "ddp": {"steps": ddp_steps, **reference},
                         "predicted_step_s": {n: p["predicted_step_s"] for n, p in plans.items()}}}


def argparse_defaults(add_arguments) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([])


def check(args) -> None:
    """A ValueError naming the first problem with the arguments, before any work starts (it also
    drops a repeated --without and reads a collective's --uniform in any case, as DataParallel does)."""
    args.without = list(dict.fromkeys(args.without))
    if args.uniform is not None and args.uniform.strip().lower() in (*UNIFORM_COLLECTIVES, "none"):
        args.uniform = args.uniform.strip().lower()
    if args.model and (args.batch_size is not None or args.workload_option or args.seed != 0):
        raise ValueError("--batch-size, --workload-option and --seed are --workload's: with --model, FUNCTION() "
                         "builds the model and one worker's batch")
    if args.batch_size is not None and args.batch_size < 1 or args.workers < 2 or args.trial < 0 \
            or args.trial_passes < 1 or not 0 < args.timeout < math.inf:
        raise ValueError("--workers must be >= 2, --batch-size >= 1, --trial >= 0, --trial-passes >= 1 and "
                         "--timeout a positive number of seconds")
    if args.dense_only and args.uniform is None:
        raise ValueError("--dense-only needs --uniform COMPRESSOR")
    if args.uniform == "none":      # uniforms_of names the uncompressed strategies by their collective
        raise ValueError(f"--uniform none: every tensor uncompressed is --uniform {RING} (or another "
                         f"collective: {', '.join(UNIFORM_COLLECTIVES[1:])})")
    if args.uniform is not None and args.uniform not in UNIFORM_COLLECTIVES \
            and args.uniform not in args.compressors:   # known before the profile's minutes
        raise ValueError(f"no {'dense-only' if args.dense_only else 'uniform'} strategy {args.uniform!r}: "
                         f"not among --compressors ({', '.join(args.compressors)})")
    if args.uniform is not None:    # a uniform strategy the planner without the dimension never takes
        compresses = args.uniform not in UNIFORM_COLLECTIVES
        if "compression" in args.without and compresses:
            raise ValueError(f"--uniform {args.uniform} compresses: --without compression rules it out")
        if "collective" in args.without and not compresses and args.uniform != RING:
            raise ValueError(f"--uniform {args.uniform} is not the ring: --without collective rules it out")
    check_output_path(args.profile, "--profile")
    check_output_path(args.json, "--json", keeps={"--profile": args.profile})
    check_network(args.network, args.link_burst, args.workers)


def run(args) -> int:
    untried = bool(args.trial) and (args.uniform is not None or args.without)     # given, and not 0
    args.trial = TRIAL_STEPS if args.trial is None else args.trial
    try:
        check(args)
        if untried:
            print("sparcoll plan: --trial is not run with --uniform or --without: the strategy asked for is "
                  "written untried", file=sys.stderr)
        profile = load_or_measure(args, identity(args))
    except ValueError as exc:
        print(f"sparcoll plan: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"sparcoll plan: {exc}", file=sys.stderr)
        return 1
    if profile["model"].get("unused"):
        print(f"sparcoll plan: left out of the plan, as backward gives them no gradient (unused in forward): "
              f"{', '.join(profile['model']['unused'])}", file=sys.stderr)
    try:
        plan = make_plan(profile, args.compressors, args.without, args.uniform, args.fusion,
                         args.dense_only)
    except ValueError as exc:
        print(f"sparcoll plan: error: {exc}", file=sys.stderr)
        return 2
    if args.trial > 0 and args.uniform is None and not args.without:
        status, plan = tried(plan, profile, args)
        if status:
            return status
    print(table(plan))
    if args.json:
        Path(args.json).write_text(json.dumps(plan, indent=1, allow_nan=False))
    return 0
