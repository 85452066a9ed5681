"""`sparcoll train`: data-parallel training of a workload with one communication mode, or two compared.

    sparcoll train --workload ncf --workers 4 --comm sparcoll --network 1gbit --steps 200 \\
                   --batch-size 256 --json out.json
    sparcoll train --workload ncf --workers 4 --compare          # sparcoll, then ddp: speedup, loss gap

A process per worker, on the hosts of an emulated network shaped to --network (root needed) or on
loopback with --network none, started and watched by the bench harness's launcher. Reports samples/s,
time per step split into computation and non-overlapped communication, gradient block density and the
loss curve (see worker.py for the definitions). --batch-size is per worker.
"""
from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys

from sparcoll.bench.launch import Job, run_job, run_jobs
from sparcoll.bench.netem import netem_available, parse_rate
from sparcoll.train.worker import MODES
from sparcoll.workloads import WORKLOADS

COMPARED = ("sparcoll", "ddp")
CURVE_POINTS = 8        # steps of the loss curve printed (the JSON report has every step)
# Every mode must be able to run the same model, so that loss curves compare: a tied softmax cannot
# have sparse embeddings (agsparse).
COMMON_OPTIONS = {"lstm": {"tie_weights": False}}
# The full-size LSTM is too heavy for CPU runs; these apply unless tiny=true or the user sets them.
SMALLER = {"lstm": {"vocab_size": 10_000, "embed_dim": 64, "hidden_dim": 64, "bptt": 20}}


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
                             "embedding gradients (default sparcoll)")
    parser.add_argument("--compare", action="store_true",
                        help="run sparcoll then ddp; print the speedup and the largest loss difference")
    parser.add_argument("--network", default="1gbit", type=lambda text: text.strip().lower(),
                        help="link rate of the emulated network (1gbit, 10gbit ...; needs root), or none: "
                             "loopback (default 1gbit)")
    parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    parser.add_argument("--batch-size", type=int, default=256,
                        help="samples per worker and step (default 256)")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the batches (default 0)")
    parser.add_argument("--block-size", type=int, default=256,
                        help="sparcoll's block size, also used to measure gradient density (default 256)")
    parser.add_argument("--data", metavar="PATH", help="the workload's data file (default: synthetic)")
    parser.add_argument("--workload-option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                        help="set a field of the workload's config, e.g. num_users=1000, hidden=64,32 or "
                             "tiny=true (the test preset); repeatable")
    parser.add_argument("--warmup", type=int, default=1,
                        help="first steps left out of the timing summary (default 1)")
    parser.add_argument("--json", metavar="PATH", help="write the configuration and results to PATH")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds without a finished step before the job is declared hung (default 600)")


def workload_options(name: str, given: list[tuple[str, object]]) -> dict:
    user = dict(given)
    return {**COMMON_OPTIONS.get(name, {}), **({} if user.get("tiny") else SMALLER.get(name, {})), **user}


def _validate(args) -> None:
    if args.workers < 1 or args.steps < 1 or args.batch_size < 1 or args.block_size < 1:
        raise ValueError("--workers, --steps, --batch-size and --block-size must be >= 1")
    if args.warmup < 0 or args.timeout <= 0:
        raise ValueError("--warmup must be >= 0 and --timeout > 0")
    if args.network != "none":
        ok, reason = netem_available()
        if not ok:
            raise ValueError(f"{reason} (or use --network none)")
        parse_rate(args.network)


def launch(config: dict, workers: int, network: str, timeout: float, on_event) -> None:
    """Run the workers of one training job with the bench harness's launcher."""
    run_job(Job(workers, network, 0, config, timeout, worker="sparcoll.train.worker",
                env={"SPARCOLL_BLOCK_SIZE": str(config["block_size"])}), on_event)


def summarize(mode: str, steps: list[dict], args) -> dict:
    """One run's record: means over the steps after the warm-up, and every step's values."""
    keys = ("step_s", "compute_s", "comm_s", "density_local", "density_union")
    timed = steps[args.warmup:] or steps
    mean = {key: statistics.fmean(s[key] for s in timed) for key in keys}
    return {"comm": mode, "samples_per_s": args.batch_size * args.workers / mean["step_s"], **mean,
            "timed_steps": len(timed), "loss": [s["loss"] for s in steps],
            "per_step": {key: [s[key] for s in steps] for key in keys}}


def compare(runs: list[dict]) -> dict:
    """How much faster the first run's steps are than the second's, and how far their losses drift."""
    fast, base = runs
    return {"speedup": base["step_s"] / fast["step_s"],
            "max_loss_difference": max(abs(a - b) for a, b in zip(fast["loss"], base["loss"]))}


def report(runs: list[dict], args) -> str:
    lines = [f"sparcoll train: {args.workload}, {args.workers} workers, network {args.network}, "
             f"{args.steps} steps of {args.batch_size} samples per worker",
             f"{'comm':<9} {'samples/s':>10} {'step ms':>8} {'compute ms':>10} {'comm ms':>8} "
             f"{'density local/union':>20}  loss first -> last"]
    for r in runs:
        lines.append(f"{r['comm']:<9} {r['samples_per_s']:>10.1f} {1e3 * r['step_s']:>8.1f} "
                     f"{1e3 * r['compute_s']:>10.1f} {1e3 * r['comm_s']:>8.1f} "
                     f"{r['density_local']:>11.4f} / {r['density_union']:.4f}  "
                     f"{r['loss'][0]:.4f} -> {r['loss'][-1]:.4f}")
    for r in runs:
        loss = r["loss"]
        shown = sorted({round(i * (len(loss) - 1) / (CURVE_POINTS - 1)) for i in range(CURVE_POINTS)})
        lines.append(f"loss curve, {r['comm']}: " + ", ".join(f"{i + 1}: {loss[i]:.4f}" for i in shown))
    return "\n".join(lines)


def run(args) -> int:
    """Train as `args` says; 0 on success, 1 if a job failed, 2 on bad arguments, 130 if interrupted."""
    try:
        _validate(args)
    except ValueError as exc:
        print(f"sparcoll train: error: {exc}", file=sys.stderr)
        return 2
    modes = COMPARED if args.compare else (args.comm,)
    config = {"workload": args.workload, "data": args.data, "options": workload_options(
                  args.workload, args.workload_option),
              "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
              "block_size": args.block_size, "timeout": args.timeout}
    runs = []

    def body(advance) -> None:
        for mode in modes:
            steps: list[dict] = []

            def on_event(event: dict) -> None:
                steps.append(event)
                advance(f"{mode}: step {event['step'] + 1}, loss {event['loss']:.4f}")

            launch({**config, "comm": mode}, args.workers, args.network, args.timeout, on_event)
            runs.append(summarize(mode, steps, args))

    status = run_jobs("train", args.steps * len(modes), body)
    if status:
        return status
    print(report(runs, args))
    result = {**config, "workers": args.workers, "network": args.network, "runs": runs}
    if args.compare:
        result["compare"] = compare(runs)
        print(f"sparcoll is {result['compare']['speedup']:.2f}x as fast as ddp per step; largest loss "
              f"difference over {args.steps} steps: {result['compare']['max_loss_difference']:.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
