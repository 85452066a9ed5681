"""`sparcoll train`: data-parallel training of a workload with one communication mode, or several compared.

    sparcoll train --workload ncf --workers 4 --comm sparcoll --network 1gbit --steps 200 \\
                   --batch-size 256 --json out.json
    sparcoll train --workload ncf --workers 4 --compare          # sparcoll, then ddp: speedup, loss gap
    sparcoll train --workload vgg --compare ddp,hook:compress=powersgd:4,hook:compress=blocktopk:0.01
    sparcoll train --workload ncf --compare ddp,poseidon,planned --plan plan.json
    sparcoll train --workload gpt --compare planned,poseidon:strategy=ring --plan plan.json --interleave

A mode is a --comm value, optionally with `:compress=SPEC` (a sparcoll.compress spec, for `hook`: DDP on
gloo with sparcoll's compression hook) or, for `poseidon` (sparcoll.torch.DataParallel) and
`poseidon-blocking` (the same without wait-free backpropagation), `:strategy=S` (ring, ps, sparse, sfb,
auto, a compressor spec, or a JSON file of tensor name -> strategy); `planned` runs the plan of
`sparcoll plan` given by --plan. Each compared mode gets its speedup over `ddp` and its largest
loss difference against `ddp` (when ddp is among them; else against the last mode). Compared modes run
one job each, one after the other; with --interleave they run in one job, a step of each in turn, and
each is also compared with the baseline step by step (paired_ratio): a machine whose speed drifts over
minutes then moves every mode alike.

A process per worker, on the hosts of an emulated network shaped to --network (root needed) or on
loopback with --network none, started and watched by the bench harness's launcher. Reports samples/s,
time per step split into computation and non-overlapped communication, gradient block density and the
loss curve (see worker.py for the definitions). --batch-size is per worker.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import os
import statistics
import sys
import types
import typing

import numpy as np
import torch

from sparcoll.bench.launch import BenchError, Job, run_job, run_jobs
from sparcoll.bench.memory import FAULTING_PAGES, took_fresh_memory
from sparcoll.bench.netem import add_link_burst_argument, check_network
from sparcoll.outputs import check_output_path
from sparcoll.options import env_block_size
from sparcoll.train.worker import MODES, plain_ddp_on_sparse_gradients
from sparcoll.wire import MAX_BLOCK_SIZE
from sparcoll import workloads
from sparcoll.workloads import WORKLOADS

COMPARED = ("sparcoll", "ddp")
CURVE_POINTS = 8        # steps of the loss curve printed (the JSON report has every step)
# Every mode must be able to run the same model, so that loss curves compare: a tied softmax cannot
# have sparse embeddings (agsparse).
COMMON_OPTIONS = {"lstm": {"tie_weights": False}}
BATCH_SIZES = {"vgg": 32, "gpt": 1}    # per worker, where 256 samples is not what the workload is for
# The full-size LSTM is too heavy for CPU runs; these apply unless tiny=true or the user sets them.
SMALLER = {"lstm": {"vocab_size": 10_000, "embed_dim": 64, "hidden_dim": 64, "bptt": 20}}
BOOLEANS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
HINTS = {bool: "true or false", tuple[int, ...]: "comma separated: 64,32, or 16, for one"}


def _option(text: str) -> tuple[str, object]:
    """key=value, the value a Python literal (tuples as comma lists: hidden=64,32 or hidden=16,),
    true/false, or else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    if raw.strip().lower() in ("true", "false"):
        return key.strip(), raw.strip().lower() == "true"
    try:
        return key.strip(), ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return key.strip(), raw


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `train` options to `parser`."""
    parser.add_argument("--workload", choices=list(WORKLOADS), default="ncf", help="default ncf")
    parser.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument("--comm", choices=MODES, default="sparcoll",
                        help="sparcoll: DDP on the sparcoll backend; ddp: DDP on gloo; hook: DDP on gloo "
                             "with sparcoll's allreduce hook; agsparse: DDP on gloo with sparse "
                             "embedding gradients (default sparcoll). --workload-option "
                             "sparse_embeddings=true gives any mode nn.Embedding(sparse=True); poseidon: "
                             "sparcoll.torch.DataParallel, wait-free, a strategy per tensor; "
                             "poseidon-blocking: the same, synchronizing only after backward")
    parser.add_argument("--compress", metavar="SPEC", default=None,
                        help="with --comm hook: compress gradients with this sparcoll.compress spec, e.g. "
                             "powersgd:4, topk:0.01, blocktopk:0.01 (default: none)")
    parser.add_argument("--strategy", default=None,
                        help="with --comm poseidon: ring, ps, sparse, sfb, auto (Poseidon's hybrid "
                             "choice, the default), a compressor spec, or a JSON file of tensor name -> "
                             "strategy")
    parser.add_argument("--plan", metavar="FILE",
                        help="with --comm planned (or planned among --compare): the plan `sparcoll "
                             "plan` wrote for this workload, its options, worker count, batch size, network, "
                             "--link-burst and --block-size (refused if made for others)")
    parser.add_argument("--compare", nargs="?", const=",".join(COMPARED), default=None, metavar="MODES",
                        help="run several modes, comma separated, each a --comm value optionally with "
                             ":compress=SPEC (hook) or :strategy=S (poseidon) (default when given alone: "
                             "sparcoll,ddp); print each one's "
                             "speedup over ddp and largest loss difference")
    parser.add_argument("--interleave", action="store_true",
                        help="with --compare: run the modes in one job, a step of each in turn (in an order "
                             "shuffled per step), so that the machine's drift over minutes falls on all of "
                             "them alike; each mode's steps are then also compared pair by pair with the "
                             "baseline's (the ratio of their mean steps and its 95%% interval). Not with "
                             "the sparcoll mode, whose DDP runs on a process group of its own backend")
    parser.add_argument("--network", default="1gbit", type=lambda text: text.strip().lower(),
                        help="link rate of the emulated network (1gbit, 10gbit ...; needs root), or none: "
                             "loopback (default 1gbit)")
    add_link_burst_argument(parser)
    parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="samples per worker and step (default 256; vgg 32, as Poseidon's "
                             "VGG19-22K; gpt 1 sequence, so that its step stays communication-bound)")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the batches (default 0)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="sparcoll's block size, also used to measure gradient density (default: "
                             "$SPARCOLL_BLOCK_SIZE's, as for a communicator, else 256)")
    parser.add_argument("--data", metavar="PATH", help="the workload's data file (default: synthetic)")
    parser.add_argument("--workload-option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                        help="set a field of the workload's config, e.g. num_users=1000 (ncf), hidden=64,32 "
                             "(vgg) or tiny=true (the test preset); repeatable")
    parser.add_argument("--warmup", type=int, default=None,
                        help="first steps left out of the timing summary (default 1; 0 with --steps 1)")
    parser.add_argument("--json", metavar="PATH", help="write the configuration and results to PATH")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds without a finished step before the job is declared hung (default 600)")


def workload_options(name: str, given: list[tuple[str, object]]) -> dict:
    """The options workload `name` is built with: the user's, checked against its Config's fields (and
    tiny, the preset) and typed as they are (a ValueError naming a bad one, before any worker builds it),
    over the defaults of this command."""
    fields = {"tiny": bool} | typing.get_type_hints(sys.modules[WORKLOADS[name].__module__].Config)
    user = {}
    for key, value in given:
        if key not in fields:
            raise ValueError(f"--workload-option {key}: {name} has no such option; its options are "
                             f"{', '.join(fields)}")
        try:
            user[key] = _typed(value, fields[key])
        except ValueError:
            kind = fields[key]
            raise ValueError(f"--workload-option {key}={value!r}: {name}'s {key} is of type "
                             f"{kind.__name__ if isinstance(kind, type) else kind}"
                             + (f" ({HINTS[kind]})" if kind in HINTS else "")) from None
    return {**COMMON_OPTIONS.get(name, {}), **({} if user.get("tiny") else SMALLER.get(name, {})), **user}


def check_builds(name: str, options: dict, given: list[tuple[str, object]], data: str | None = None) -> None:
    """Where the user gave workload options (`given`), build the workload once here, on the meta device
    (no memory: milliseconds, plus reading `data` as the workers do, which decides some sizes), so that
    a value it refuses (num_users=-5, dropout=2) is named before any worker starts, not in every
    worker's traceback after it started (a review). Where the meta build alone fails, a real one
    decides."""
    if not given:
        return
    try:
        with torch.device("meta"):
            workloads.get_workload(name, data=data, **options)
        return
    except Exception:
        pass
    try:
        workloads.get_workload(name, data=data, **options)
    except Exception as exc:
        shown = " ".join(f"{key}={value!r}" for key, value in given)
        raise ValueError(f"--workload-option {shown}: {name} cannot be built so ({type(exc).__name__}: {exc})") \
            from None


def _typed(value: object, kind) -> object:
    """`value` as _option parsed it, as a config field of type `kind` holds it; ValueError if it is not
    one (a workload would take a string for a true bool, or fail in every worker)."""
    if kind is bool and str(value).lower() in BOOLEANS:
        return BOOLEANS[str(value).lower()]
    if kind is float and type(value) is int:
        return float(value)
    if isinstance(kind, type) and type(value) is kind:
        return value
    if typing.get_origin(kind) is tuple and isinstance(value, tuple):
        return tuple(_typed(v, typing.get_args(kind)[0]) for v in value)
    for option in typing.get_args(kind) if typing.get_origin(kind) in (types.UnionType, typing.Union) else ():
        try:
            return _typed(value, option)
        except ValueError:
            pass
    raise ValueError(f"not a {kind}")


def parse_mode(text: str) -> tuple[str, str | None]:
    """'hook:compress=topk:0.01' -> ('hook', 'topk:0.01'); 'poseidon:strategy=sfb' -> ('poseidon',
    'sfb'); 'ddp' -> ('ddp', None). ValueError if bad."""
    from sparcoll.compress import parse
    from sparcoll.torch.parallel import check_strategy

    text = text.strip()
    comm, _, option = text.partition(":")
    if comm not in MODES:
        raise ValueError(f"unknown mode {comm!r}; modes are {', '.join(MODES)}, optionally with "
                         f":compress=SPEC (hook) or :strategy=S (poseidon)")
    if not option:
        return comm, None
    key, _, value = option.partition("=")
    if (comm, key) == ("hook", "compress"):
        parse(value)
    elif comm.startswith("poseidon") and key == "strategy":
        check_strategy(value)
    elif key == "compress":
        raise ValueError(f"{text!r}: compression runs in the hook; use hook:compress=SPEC")
    else:
        raise ValueError(f"{text!r}: expected hook:compress=SPEC or poseidon:strategy=S")
    return comm, value


def modes_of(args) -> list[tuple[str, str | None]]:
    if args.compare is not None:
        ignored = [option for option, given in (("--comm", args.comm != "sparcoll"), ("--compress", args.compress),
                                                ("--strategy", args.strategy)) if given]
        if ignored:
            raise ValueError(f"{' and '.join(ignored)} would be ignored: --compare names each mode with its "
                             f"own settings (e.g. hook:compress=topk:0.01, poseidon:strategy=sfb)")
        return _split_modes(args.compare)
    if args.compress is not None and args.comm != "hook":
        raise ValueError("--compress needs --comm hook (compression runs in the DDP hook)")
    if args.strategy is not None and not args.comm.startswith("poseidon"):
        raise ValueError("--strategy needs --comm poseidon")
    if args.compress is not None:
        return [parse_mode(f"hook:compress={args.compress}")]
    if args.strategy is not None:
        return [parse_mode(f"{args.comm}:strategy={args.strategy}")]
    return [parse_mode(args.comm)]


def _split_modes(text: str) -> list[tuple[str, str | None]]:
    """Modes separated by commas, where a spec may hold commas too: a comma after a mode with a spec
    continues it with an option (KEY=VALUE, compress.spec's format) unless a mode name follows;
    anything else is a mode (a misspelled one is then named alone)."""
    parts = []
    for piece in filter(str.strip, text.split(",")):
        name = piece.strip().partition(":")[0]
        if parts and ":" in parts[-1] and "=" in piece and name not in MODES:
            parts[-1] += f",{piece}"
        else:
            parts.append(piece)
    if not parts:
        raise ValueError(f"--compare {text!r}: no mode given; e.g. --compare ddp,sparcoll")
    return [parse_mode(p) for p in parts]


def check_interleave(args, modes: list[tuple[str, str | None]]) -> None:
    """ValueError unless --interleave can run these modes in one job."""
    if not args.interleave:
        return
    if args.compare is None or len(modes) < 2:
        raise ValueError("--interleave needs --compare with two modes or more")
    if any(comm == "sparcoll" for comm, _ in modes):
        raise ValueError("--interleave cannot run the sparcoll mode: its DDP needs a process group of the "
                         "sparcoll backend, the other modes one of gloo; compare it without --interleave "
                         "(or use hook, the same allreduce from a DDP hook)")


def _validate(args) -> None:
    if args.batch_size is None:
        args.batch_size = BATCH_SIZES.get(args.workload, 256)
    if args.block_size is None:     # (a plan made under $SPARCOLL_BLOCK_SIZE was refused without it: a review)
        args.block_size = env_block_size()
    if args.workers < 1 or args.steps < 1 or args.batch_size < 1 or args.block_size < 1:
        raise ValueError("--workers, --steps, --batch-size and --block-size must be >= 1")
    if args.block_size > MAX_BLOCK_SIZE:
        raise ValueError(f"--block-size must be at most {MAX_BLOCK_SIZE}, got {args.block_size}")
    if args.warmup is None:     # a one-step run (a smoke test) times its only step
        args.warmup = min(1, args.steps - 1)
    if args.warmup < 0 or not 0 < args.timeout < math.inf:
        raise ValueError("--warmup must be >= 0 and --timeout a positive number of seconds")
    if not 0 < args.lr < math.inf:
        raise ValueError(f"--lr must be a positive number, got {args.lr}")
    if args.data is not None and not os.path.isfile(args.data):
        raise ValueError(f"--data {args.data}: no such file")
    if args.warmup >= args.steps:
        raise ValueError(f"--warmup {args.warmup} leaves none of the --steps {args.steps} to time; "
                         f"give more steps or a smaller --warmup")
    check_output_path(args.json, "--json", keeps={"--plan": args.plan})
    check_network(args.network, args.link_burst, args.workers)


def check_sparse_embeddings(workload: str, modes, options: dict) -> None:
    """A mode with sparse embeddings (agsparse, or sparse_embeddings=true) on a model whose softmax is
    tied to its embedding (gpt's default): refused here, where every worker refused it in a traceback
    and the runs of the modes before it were lost."""
    config = getattr(getattr(workloads, workload, None), "Config", None)
    fields = {f.name: f.default for f in dataclasses.fields(config)} if config is not None else {}
    tied = options.get("tie_weights", fields.get("tie_weights", False))
    sparse = [label(mode) for mode in modes if mode[0] == "agsparse" or options.get("sparse_embeddings")]
    if tied and sparse:
        raise ValueError(f"{', '.join(sparse)} needs sparse embeddings, which {workload}'s tied softmax makes "
                         f"dense: add --workload-option tie_weights=false (for every mode, so that their "
                         f"models compare)")


def load_plan(args, modes, options: dict) -> dict | None:
    """The plan of the planned mode (None if no mode is planned): for this workload, its `options`
    (workload_options), worker count, batch size, network, link burst and block size, else a
    ValueError saying what differs."""
    if not any(comm == "planned" for comm, _ in modes):
        if args.plan:
            raise ValueError("--plan needs --comm planned or planned among --compare")
        return None
    if not args.plan:
        raise ValueError("the planned mode needs --plan FILE (written by `sparcoll plan --json FILE`)")
    try:
        with open(args.plan) as f:
            plan = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the plan {args.plan}: {exc}") from None
    if not isinstance(plan, dict) or not isinstance(plan.get("tensors"), list):
        raise ValueError(f"{args.plan} is not a plan of `sparcoll plan` (no 'tensors' list)")
    if "model_spec" in plan:
        raise ValueError(f"{args.plan} was made for the model {plan['model_spec']} (sparcoll plan --model), "
                         f"this run trains the workload {args.workload}")
    # and what its costs were measured at: the network and its links' burst (None: netem's default), the
    # sparse AllReduce's block size (a plan of an older sparcoll may lack them: not checked)
    for key in ("workload", "workers", "batch_size", "network", "link_burst", "block_size"):
        if key in plan and plan[key] != getattr(args, key):
            raise ValueError(f"{args.plan} was made for {key} {_shown(plan[key])}, this run has "
                             f"{_shown(getattr(args, key))}")
    options = json.loads(json.dumps(options))       # as the plan's JSON holds them (tuples as lists)
    if "options" in plan and plan["options"] != options:
        def listed(given: dict) -> str:
            return ", ".join(f"{k}={v}" for k, v in given.items()) or "none"
        raise ValueError(f"{args.plan} was made with the workload options {listed(plan['options'])}, this run "
                         f"has {listed(options)} (--workload-option)")
    return plan


def _finite(value):
    """`value` (nested) with every float that is not finite as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _shown(value) -> str:
    """A plan's or a run's setting as --link-burst's None reads."""
    return "the default" if value is None else str(value)


#: How many times a job of plain DDP on sparse gradients is run again after a crash in native code.
CRASH_RETRIES = 2


def launch(config: dict, workers: int, network: str, timeout: float, on_event) -> None:
    """Run the workers of one training job with the bench harness's launcher. Plain DDP on sparse
    gradients crashes in native code now and then (torch 2.13's gloo, its sparse all_reduce on two
    worker threads; docs/reliability.md): such a job is run again after a crash, up to CRASH_RETRIES
    times, with a warning, on_event getting {"event": "restart", "crashed": [names]} first so the
    caller drops the steps of the run that crashed. Any other failure is raised at once."""
    job = Job(workers, network, 0, config, timeout, worker="sparcoll.train.worker",
              env={"SPARCOLL_BLOCK_SIZE": str(config["block_size"])}, link_burst=config.get("link_burst"))
    for attempt in range(CRASH_RETRIES + 1):
        try:
            return run_job(job, on_event)
        except BenchError as failure:      # the job's kind asked only now: a user's model is built for it
            if attempt == CRASH_RETRIES or not failure.crashed or not any(
                    plain_ddp_on_sparse_gradients({**config, **mode}) for mode in config.get("modes") or [{}]):
                raise
            print(f"warning: DDP on gloo crashed in native code: {', '.join(failure.crashed)}; torch 2.13's "
                  f"gloo does so now and then with sparse gradients (docs/reliability.md); running the job "
                  f"again", file=sys.stderr)
            on_event({"event": "restart", "crashed": list(failure.crashed)})


def final_loss(losses: list[float], held_out: float | None) -> tuple[float, str]:
    """The loss a run ended with: on the held-out split where the workload has one, else the mean
    training loss of the last tenth of the steps (one step's loss on a small batch is noise)."""
    if held_out is not None:
        return held_out, "held-out"
    window = max(1, len(losses) // 10)
    return statistics.fmean(losses[-window:]), f"training, mean of the last {window} steps"


def timed_steps(steps: list[dict], warmup: int) -> list[dict]:
    """The step events whose times count: after the `warmup` first, and not probed (the worker marked
    their gradients' densities inside backward, worker.PROBE_EVERY); all of them if none is left."""
    return [s for s in steps[warmup:] if not s.get("probed")] or steps[warmup:] or steps


def summarize(mode: tuple[str, str | None], steps: list[dict], args, held_out: float | None = None) -> dict:
    """One run's record: times averaged over the timed steps, densities over the probed ones, every
    step's values, and the final loss."""
    keys = ("step_s", "compute_s", "comm_s", "cpu_s", "cpu_mean_s", "training_thread_cpu_s", "reference_cpu_s",
            "density_local", "density_union")
    timed = timed_steps(steps, args.warmup)
    probed = [s for s in steps if s.get("probed")] or steps
    mean = {key: statistics.fmean(s[key] for s in (probed if key.startswith("density") else timed))
            for key in keys}
    sent = [s["bytes_sent"] for s in timed if s.get("bytes_sent") is not None]
    losses = [s["loss"] for s in steps]
    final, kind = final_loss(losses, held_out)
    predicted = [s["predicted_bytes"] for s in timed if s.get("predicted_bytes") is not None]
    faults = [s["page_faults"] for s in timed]
    optional = {key: statistics.fmean(s[key] for s in timed)
                for key in ("comm_total_s", "comm_hidden_s", "slowest_step_s") if all(key in s for s in timed)}
    return {"comm": mode[0], **option_of(mode), "label": label(mode),
            "predicted_bytes_per_step": statistics.fmean(predicted) if predicted else None, **optional,
            "samples_per_s": args.batch_size * args.workers / mean["step_s"], **mean,
            "bytes_sent_per_step": statistics.fmean(sent) if sent else None,
            "timed_steps": len(timed), "faulting_steps": sum(map(took_fresh_memory, faults)),
            "most_page_faults": max(faults),
            "loss": losses, "final_loss": final, "final_loss_kind": kind,
            "per_step": {key: [s[key] for s in steps] for key in keys + ("page_faults",) + tuple(optional)}
            | {"probed": [bool(s.get("probed")) for s in steps]}}


def option_of(mode: tuple[str, str | None]) -> dict:
    """The mode's option as the worker's config and the report name it: a hook's compressor spec,
    DataParallel's strategy."""
    comm, option = mode
    return {"compress": option if comm == "hook" else None,
            "strategy": (option or "auto") if comm.startswith("poseidon") else None}


def label(mode: tuple[str, str | None]) -> str:
    comm, spec = mode
    return comm if spec is None else f"{comm}:{spec}"


def compare(runs: list[dict], paired: bool = False, warmup: int = 0) -> dict:
    """Every run against the baseline (ddp if it ran, else the last run): how much faster its steps
    are, how far its losses drift, and its final loss relative to the baseline's; with `paired` (the
    runs interleaved, step k of each run next to step k of the others) also compare_paired's figures."""
    base = next((r for r in runs if r["comm"] == "ddp"), runs[-1])
    return {"baseline": base["label"], "modes": [
        {"label": r["label"], "speedup": base["step_s"] / r["step_s"],
         "max_loss_difference": max_loss_difference(r["loss"], base["loss"]),
         "final_loss_difference": (r["final_loss"] - base["final_loss"]) / abs(base["final_loss"]),
         **(compare_paired(base, r, warmup) if paired else {})}
        for r in runs if r is not base]}


def max_loss_difference(losses: list, base: list) -> float:
    """The largest |loss - base's| over the steps; infinite where one is not finite and the other is
    (a run that diverged: max() skips NaN, and reported the steps before it)."""
    return max((abs(a - b) if math.isfinite(a - b) else (0.0 if a == b else math.inf)
                for a, b in zip(losses, base)), default=0.0)


def compare_paired(base: dict, run: dict, warmup: int) -> dict:
    """paired_ratio of two interleaved runs over their timed steps, and (if some took fresh memory)
    over the steps in which neither did."""
    out = {"paired": paired_ratio(*paired_steps(base, run, warmup))}
    settled = paired_steps(base, run, warmup, fresh_memory=False)
    if 0 < len(settled[0]) < out["paired"]["steps"]:
        out["paired_without_fresh_memory"] = paired_ratio(*settled)
    return out


def paired_steps(base: dict, run: dict, warmup: int, fresh_memory: bool = True) -> tuple[list, list]:
    """Two interleaved runs' timed step times (timed_steps), step k of one beside step k of the other;
    without `fresh_memory`, only the steps in which neither took fresh memory (bench.memory: a heap
    that grew, which several models in one process make more frequent)."""
    def timed(r: dict) -> list[dict]:
        per_step = r["per_step"]
        faults = per_step.get("page_faults") or [0] * len(per_step["step_s"])     # (reports before them)
        return timed_steps([{"step_s": t, "probed": p, "page_faults": f}
                            for t, p, f in zip(per_step["step_s"], per_step["probed"], faults)], warmup)

    pairs = [(a, b) for a, b in zip(timed(base), timed(run))
             if fresh_memory or not took_fresh_memory(max(a["page_faults"], b["page_faults"]))]
    return [a["step_s"] for a, _ in pairs], [b["step_s"] for _, b in pairs]


def paired_ratio(base: list[float], other: list[float], resamples: int = 2000) -> dict:
    """How many times faster `other`'s steps are than `base`'s, where step k of each ran next to the
    other's: the ratio of their mean steps (what throughput compares), with a 95% percentile bootstrap
    interval over the steps, resampled in pairs (a fixed seed: the same figures from the same steps),
    and the median of the steps' own ratios (which one slow step does not move)."""
    base, other = np.asarray(base, dtype=float), np.asarray(other, dtype=float)
    picks = np.random.default_rng(0).integers(0, len(base), size=(resamples, len(base)))
    low, high = np.percentile(base[picks].sum(axis=1) / other[picks].sum(axis=1), [2.5, 97.5])
    return {"steps": len(base), "ratio": float(base.sum() / other.sum()), "low": float(low),
            "high": float(high), "median": float(np.median(base / other))}


class Collected:
    """What one mode's job reported: its steps, the held-out loss, the trace, crashes run again."""

    def __init__(self):
        self.steps: list[dict] = []
        self.held_out: list[float] = []
        self.traces: list[dict] = []
        self.restarts: list[list[str]] = []

    def add(self, event: dict) -> None:
        kind = event.get("event")
        if kind == "eval":
            self.held_out.append(event["loss"])
        elif kind == "trace":
            self.traces.append({k: v for k, v in event.items() if k not in ("event", "mode")})
        else:
            self.steps.append(event)

    def restart(self, crashed: list[str]) -> None:
        """The steps so far are of a run that crashed: dropped."""
        self.restarts.append(crashed)
        self.steps.clear()
        self.held_out.clear()
        self.traces.clear()


def report(runs: list[dict], args) -> str:
    lines = [f"sparcoll train: {args.workload}, {args.workers} workers, network {args.network}, "
             f"{args.steps} steps of {args.batch_size} samples per worker",
             f"{'mode':<24} {'samples/s':>10} {'step ms':>8} {'compute ms':>10} {'comm ms':>8} "
             f"{'CPU ms':>7} {'MB/step/wkr':>11} {'density local/union':>20}  loss first -> last"]
    for r in runs:
        sent = "-" if r["bytes_sent_per_step"] is None else f"{r['bytes_sent_per_step'] / 1e6:.2f}"
        lines.append(f"{r['label']:<24} {r['samples_per_s']:>10.1f} {1e3 * r['step_s']:>8.1f} "
                     f"{1e3 * r['compute_s']:>10.1f} {1e3 * r['comm_s']:>8.1f} {1e3 * r['cpu_s']:>7.1f} {sent:>11} "
                     f"{r['density_local']:>11.4f} / {r['density_union']:.4f}  "
                     f"{r['loss'][0]:.4f} -> {r['loss'][-1]:.4f}")
    for r in runs:
        if r.get("comm_total_s"):
            lines.append(f"{r['label']}: synchronization {1e3 * r['comm_total_s']:.1f} ms per step, "
                         f"{100 * r['comm_hidden_s'] / r['comm_total_s']:.0f}% of it before backward "
                         f"had finished computing"
                         + (f"; predicted {r['predicted_bytes_per_step'] / 1e6:.2f} MB sent per step"
                            if math.isfinite(r["predicted_bytes_per_step"] or float("nan")) else ""))
    for r in runs:
        if r["faulting_steps"]:
            lines.append(f"{r['label']}: {r['faulting_steps']} of {r['timed_steps']} timed steps faulted "
                         f"{FAULTING_PAGES} pages or more in on some rank (fresh memory: a heap that grew), "
                         f"at most {r['most_page_faults']}")
    lines.append(f"final loss ({runs[0]['final_loss_kind']}): "
                 + ", ".join(f"{r['label']} {r['final_loss']:.4f}" for r in runs))
    for r in runs:
        loss = r["loss"]
        shown = sorted({round(i * (len(loss) - 1) / (CURVE_POINTS - 1)) for i in range(CURVE_POINTS)})
        lines.append(f"loss curve, {r['label']}: " + ", ".join(f"{i + 1}: {loss[i]:.4f}" for i in shown))
    return "\n".join(lines)


def run(args) -> int:
    """Train as `args` says; 0 on success, 1 if a job failed, 2 on bad arguments, 130 if interrupted."""
    try:
        _validate(args)
        modes = modes_of(args)
        check_interleave(args, modes)
        options = workload_options(args.workload, args.workload_option)
        check_sparse_embeddings(args.workload, modes, options)
        check_builds(args.workload, options, args.workload_option, args.data)
        plan = load_plan(args, modes, options)
    except ValueError as exc:
        print(f"sparcoll train: error: {exc}", file=sys.stderr)
        return 2
    config = {"workload": args.workload, "data": args.data, "options": options,
              "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
              "block_size": args.block_size, "timeout": args.timeout, "link_burst": args.link_burst}
    runs = []

    def mode_config(mode: tuple[str, str | None]) -> dict:
        return {"comm": mode[0], **option_of(mode), **({"strategy": plan} if mode[0] == "planned" else {})}

    def body(advance) -> None:
        if args.interleave:
            jobs = [(modes, {**config, "comm": None, "modes": [mode_config(m) for m in modes]})]
        else:
            jobs = [([mode], {**config, **mode_config(mode)}) for mode in modes]
        for job_modes, job_config in jobs:
            collected = [Collected() for _ in job_modes]

            def on_event(event: dict) -> None:
                if event.get("event") == "restart":     # the steps so far are of a run that crashed
                    advance(f"{', '.join(map(label, job_modes))}: crashed in native code, again",
                            more=sum(len(c.steps) for c in collected) + 1)
                    for c in collected:
                        c.restart(event["crashed"])
                    return
                index = event.get("mode", 0)
                collected[index].add(event)
                if event.get("event") == "step":
                    advance(f"{label(job_modes[index])}: step {event['step'] + 1}, loss {event['loss']:.4f}")

            launch(job_config, args.workers, args.network, args.timeout, on_event)
            for mode, c in zip(job_modes, collected):
                runs.append(summarize(mode, c.steps, args, c.held_out[0] if c.held_out else None))
                if c.restarts:
                    runs[-1]["crashed_runs"] = c.restarts     # the processes a crash ended, run by run
                if c.traces:
                    runs[-1]["trace"] = c.traces[0]

    status = run_jobs("train", args.steps * len(modes), body)
    if status:
        return status
    print(report(runs, args))
    result = {**config, "workers": args.workers, "network": args.network, "warmup": args.warmup,
              "interleaved": args.interleave, "runs": runs}
    if len(runs) > 1:
        result["compare"] = compare(runs, paired=args.interleave, warmup=args.warmup)
        for m in result["compare"]["modes"]:
            print(f"{m['label']} is {m['speedup']:.2f}x as fast as {result['compare']['baseline']} "
                  f"per step; largest loss difference over {args.steps} steps: "
                  f"{m['max_loss_difference']:.3g}; final loss {100 * m['final_loss_difference']:+.1f}%")
            if "paired" in m:
                p = m["paired"]
                print(f"  step by step ({p['steps']} interleaved steps): {p['ratio']:.3f}x (95% interval "
                      f"{p['low']:.3f}-{p['high']:.3f}x), the steps' median ratio {p['median']:.3f}x")
            if "paired_without_fresh_memory" in m:
                p = m["paired_without_fresh_memory"]
                print(f"  over the {p['steps']} of them in which neither took fresh memory: {p['ratio']:.3f}x "
                      f"({p['low']:.3f}-{p['high']:.3f}x)")
    if args.json:
        with open(args.json, "w") as f:       # strict JSON: a NaN (a diverged loss) as null
            json.dump(_finite(result), f, indent=1, allow_nan=False)
    return 0
