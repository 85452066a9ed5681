"""`sparcoll bench`: time allreduce algorithms on the same inputs, on an emulated network or on loopback.

    sparcoll bench --workers 4 --numel 16M --density 0.01,0.1,1 --algos sparcoll,sparse,ring \\
                   --network 1gbit --repeat 10 --json results.json --plot results.png

One job per worker count (`--workers 2,4,8` sweeps): a process per worker, each on its own host of an
emulated network whose links are shaped to `--network` in both directions (root and iproute2 needed), or
all on 127.0.0.1 with `--network none`. Every repetition of every algorithm is checked against the exact
sum; a wrong sum fails the run, and a run that fails or is interrupted still reports (and writes) the
results that finished, naming those missing. See worker.py for how time and traffic are measured,
bounds.py for the lower bounds, report.py for the reported quantities.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable

from sparcoll.algorithm import GATHER_ELEMENTS
from sparcoll.bench import algorithms
from sparcoll.bench.arguments import check_shared
from sparcoll.bench.launch import Job, check_job_threads, run_job, run_jobs
from sparcoll.bench.netem import add_link_burst_argument, check_network
from sparcoll.bench.patterns import InputSpec
from sparcoll.bench.report import Setup, add_speedups, make_record, missing, table, title, write_json
from sparcoll.bench.sizes import comma_list, count_argument, parse_count
from sparcoll.outputs import check_figure_path, check_output_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `bench` options to `parser` (the project CLI's subcommand)."""
    parser.add_argument("--workers", type=comma_list(int, unique=True), default=[4],
                        help="number of workers, or a comma list to sweep (e.g. 2,4,8); default 4")
    parser.add_argument("--numel", type=count_argument, default=parse_count("16M"),
                        help="elements of the float32 tensor: 16M, 1M, 65536 ... (default 16M)")
    parser.add_argument("--block-size", type=int, default=256,
                        help="sparcoll's block size, the most elements per block (default 256)")
    parser.add_argument("--row-width", type=int, default=None,
                        help="elements per non-zero unit of the inputs, e.g. 32 for embedding rows of 32 "
                             "(default: the block size); densities are then shares of rows")
    parser.add_argument("--density", type=comma_list(float, unique=True), default=[0.01, 0.1, 1.0],
                        help="block densities in (0, 1], comma separated (default 0.01,0.1,1)")
    parser.add_argument("--algos", type=comma_list(str, unique=True),
                        default=["sparcoll", "sparse", "ring", "agsparse", "ps"],
                        help="algorithms, comma separated (sparcoll: as users get it; sparse: sparcoll "
                             "forced onto its sparse AllReduce), from: " + ", ".join(
                            dict.fromkeys(name for name, _ in algorithms.REGISTRY)))
    parser.add_argument("--aggregators", choices=["colocated", "dedicated"], default="colocated",
                        help="sparcoll's aggregators: a thread in each worker, or processes on their own hosts")
    parser.add_argument("--num-aggregators", type=int, default=None,
                        help="dedicated aggregators (default: as many as workers)")
    parser.add_argument("--network", default="1gbit", type=lambda text: text.strip().lower(),
                        help="link rate of the emulated network (1gbit, 10gbit, 100mbit ...; needs root), "
                             "or none: all processes on loopback (default 1gbit)")
    add_link_burst_argument(parser)
    parser.add_argument("--repeat", type=int, default=10, help="timed repetitions per point (default 10)")
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"untimed repetitions first, at every point (default {algorithms.DEFAULT_WARMUP}; "
                             f"{algorithms.SETTLING_WARMUP} for sparcoll's automatic choice, which by then has "
                             f"seen a new density and timed both its paths; a tensor small enough to gather, at "
                             f"most {GATHER_ELEMENTS} elements over all workers, keeps the path chosen at the first point)")
    parser.add_argument("--overlap", type=float, default=0.0,
                        help="fraction of each worker's non-zero blocks drawn from a pattern shared by all "
                             "workers (default 0: independent patterns)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the input patterns and values")
    parser.add_argument("--json", metavar="PATH", help="write one record per result row to PATH")
    parser.add_argument("--plot", metavar="PATH",
                        help="write a figure to PATH, in the format its extension names (.png, .pdf, .svg ...)")
    parser.add_argument("--launcher", choices=["direct", "torchrun"], default="direct",
                        help="how workers start: direct (this command starts each one) or torchrun (an "
                             "agent per emulated host, c10d rendezvous, as multi-host jobs launch; needs "
                             "--network)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds without progress before a job is declared hung (default 600)")


def _validate(args) -> tuple[list[algorithms.Algorithm], int | None]:
    """The selected algorithm variants and the link rate (None on loopback); ValueError if invalid."""
    algos = algorithms.select(args.algos)
    check_shared(args, [args.aggregators], any(a.needs_communicator for a in algos), args.network)
    if args.row_width is None:
        args.row_width = args.block_size
    if args.row_width < 1:
        raise ValueError(f"--row-width must be >= 1, got {args.row_width}")
    if args.numel % args.row_width:
        raise ValueError(f"--numel {args.numel} must be a multiple of --row-width {args.row_width}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if args.repeat < 1 or (args.warmup is not None and args.warmup < 0) or not 0 < args.timeout < math.inf:
        raise ValueError("--repeat must be >= 1, --warmup >= 0, --timeout a positive number of seconds")
    check_output_path(args.json, "--json")
    check_figure_path(args.plot, "--plot", keeps={"--json": args.json})
    if args.network == "none" and args.launcher == "torchrun":
        raise ValueError("--launcher torchrun runs one agent per emulated host: give --network")
    most = max(args.workers)
    dedicated = args.aggregators == "dedicated"     # (check_shared refused it without sparcoll's algorithms)
    rate = check_network(args.network, args.link_burst, most + ((args.num_aggregators or most) if dedicated else 0))
    check_job_threads(most, dedicated, args.num_aggregators)
    return algos, rate


def _run_workers(n: int, args, algos: list[algorithms.Algorithm], rate_bps: int | None,
                 advance: Callable[[str], None], records: list[dict]) -> None:
    """One job with `n` workers: every density and algorithm, each result's record added to `records`
    as it comes (those of a job that fails later are kept). advance(what) counts each finished
    repetition."""
    num_aggregators = args.num_aggregators or n
    dedicated = args.aggregators == "dedicated"
    setup = Setup(args.network, rate_bps, args.aggregators, num_aggregators, args.launcher, args.link_burst,
                  cores=len(os.sched_getaffinity(0)))
    specs = {d: InputSpec(args.numel, args.row_width, n, d, args.overlap, args.seed) for d in args.density}
    unions = {d: spec.union_density() for d, spec in specs.items()}
    config = {"numel": args.numel, "block_size": args.block_size, "row_width": args.row_width,
              "densities": args.density,
              "overlap": args.overlap, "seed": args.seed, "algos": [[a.name, a.input] for a in algos],
              "warmup": args.warmup, "repeat": args.repeat, "timeout": args.timeout}

    def on_event(event: dict) -> None:
        if event["event"] == "rep":
            algo = algorithms.REGISTRY[(event["algo"], event["input"])]
            advance(f"{n} workers, {algo.label}, density {event['density']:g}")
        elif event["event"] == "result":
            density = event["density"]
            records.append(make_record(event, specs[density], setup, unions[density], args.block_size))

    run_job(Job(n, args.network, num_aggregators if dedicated else 0, config, args.timeout,
                launcher=args.launcher, link_burst=args.link_burst), on_event)


def run(args, prog: str = "sparcoll bench") -> int:
    """Run the benchmark described by parsed `args`; 0 on success, 1 if it failed, 2 on bad arguments
    (said under `prog`, the command the user ran)."""
    try:
        algos, rate_bps = _validate(args)
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    steps = len(args.workers) * len(args.density) * sum(a.warmup(args.warmup) + args.repeat for a in algos)
    records = []

    def body(advance: Callable[[str], None]) -> None:
        for n in args.workers:
            _run_workers(n, args, algos, rate_bps, advance, records)

    status = run_jobs(prog.removeprefix("sparcoll "), steps, body)   # its failure said under `prog` too
    if not records:
        return status
    # What finished is kept, even when a later job failed or was interrupted (a 3-worker job's
    # Ctrl-C once threw a finished 2-worker sweep away).
    add_speedups(records)
    print(title(records))
    print(table(records))
    lacking = missing(records, args.workers, [(a.name, a.input) for a in algos], args.density)
    if lacking:
        print(f"{prog}: the sweep is incomplete: the table" + (" and the outputs" if args.json or args.plot else "")
              + f" hold what finished; missing: {'; '.join(lacking)}", file=sys.stderr)
    if args.json:
        write_json(records, args.json)
    if args.plot:
        from sparcoll.bench.plot import plot  # matplotlib only when a figure is asked for
        plot(records, args.plot)
    return status
