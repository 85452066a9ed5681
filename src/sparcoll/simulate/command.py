"""`sparcoll simulate`: predicted seconds per allreduce for each algorithm, worker count, link rate and
density, from the costs measured on this machine (see sparcoll.simulate)."""
from __future__ import annotations

import argparse
import itertools
import os
import sys

from ..bench import bounds
from ..bench.arguments import check_shared
from ..bench.netem import parse_rate
from ..bench.report import write_json
from ..bench.sizes import comma_list, count_argument, format_count, parse_count
from ..options import DEFAULT_CREDITS
from ..outputs import check_figure_path, check_output_path
from .costs import DEFAULT_PATH, Costs
from .model import ALGOS, Point, predict

DEFAULT_WORKERS = [2, 4, 8, 16, 32, 64, 128, 256]
CALIBRATION_ROUNDS = 3


def _rate(text: str) -> float | None:
    """A link rate in bit/s, or None for none (loopback: unshaped); a ValueError that offers none too."""
    text = text.strip().lower()
    if text in ("none", "loopback"):
        return None
    try:
        return float(parse_rate(text))
    except ValueError as exc:
        raise ValueError(f"{exc}; or none (unshaped)") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=comma_list(int, unique=True), default=DEFAULT_WORKERS,
                        help="worker counts, comma separated (default 2,4,...,256)")
    parser.add_argument("--network", type=comma_list(_rate, unique=True), default=[1e9, 1e10, 1e11],
                        help="link rates, comma separated (none: loopback, unshaped); default 1gbit,10gbit,100gbit")
    parser.add_argument("--numel", type=count_argument, default=parse_count("16M"),
                        help="float32 elements (default 16M)")
    parser.add_argument("--density", type=comma_list(float, unique=True), default=[0.01, 0.1, 1.0],
                        help="block densities of every worker, independent patterns (default 0.01,0.1,1)")
    parser.add_argument("--overlap", type=float, default=0.0,
                        help="share of each worker's blocks common to all workers, as sparcoll bench's "
                             "(default 0: independent patterns)")
    parser.add_argument("--algos", type=comma_list(str, unique=True), default=["sparse", "ring", "ps", "agsparse"],
                        help="from: " + ", ".join(ALGOS) + " (sparcoll: as users get it, its chooser settled; "
                             "sparse: its sparse AllReduce forced)")
    parser.add_argument("--aggregators", type=comma_list(str, unique=True), default=["colocated"],
                        help="sparcoll's aggregators: colocated, dedicated, or colocated,dedicated for both")
    parser.add_argument("--num-aggregators", type=int, default=None,
                        help="dedicated aggregators (default: as many as workers)")
    parser.add_argument("--block-size", type=int, default=256, help="elements per block (default 256)")
    parser.add_argument("--credits", type=int, default=DEFAULT_CREDITS,
                        help=f"sparcoll's messages in flight per stream, as SPARCOLL_CREDITS (default {DEFAULT_CREDITS})")
    parser.add_argument("--link-burst", type=count_argument, default=None, metavar="BYTES",
                        help="a token bucket on every shaped link, as sparcoll bench --link-burst's (e.g. 1M, "
                             "the emulated network's at 1gbit); default none: links that never send above their "
                             "rate")
    parser.add_argument("--cores", type=int, default=None,
                        help="all hosts share this many cores, as the emulated hosts of one machine do "
                             "(default: every host has its own)")
    parser.add_argument("--costs", default=str(DEFAULT_PATH),
                        help="measured costs (default: the calibration shipped, made on the development machine)")
    parser.add_argument("--calibrate", metavar="PATH",
                        help="measure the costs on this machine, write them to PATH and stop (about 3 minutes; "
                             "the link's goodput needs root)")
    parser.add_argument("--json", metavar="PATH", help="write one record per predicted point to PATH")
    parser.add_argument("--plot", metavar="PATH",
                        help="write a figure (its format from PATH's extension: .png, .pdf, .svg ...): time "
                             "against workers, per network and density")


def check(args: argparse.Namespace) -> None:
    """A ValueError naming a wrong option, checked as sparcoll bench checks it where both have it."""
    shaped = [rate for rate in args.network if rate is not None]
    check_shared(args, args.aggregators, any(algo in bounds.SPARCOLL_ALGOS for algo in args.algos),
                 network_name(shaped[0]) if shaped else "none")


def points(args: argparse.Namespace) -> list[Point]:
    """Every point the arguments name, checked (a bad one raises ValueError naming it). The algorithms
    without aggregators of their own (all but sparse and sparcoll) are simulated once, whatever the
    layouts: the ring stays the baseline of dedicated aggregators too."""
    out = []
    for rate, (i, layout), density, workers, algo in itertools.product(
            args.network, enumerate(args.aggregators), args.density, args.workers, args.algos):
        ours = algo in bounds.SPARCOLL_ALGOS
        if not ours and i:
            continue          # simulated with the first layout
        out.append(Point(algo, workers, args.numel, density, rate, aggregators=layout if ours else "colocated",
                         num_aggregators=args.num_aggregators if ours and layout == "dedicated" else None,
                         overlap=args.overlap, cores=args.cores, block_size=args.block_size,
                         credits=args.credits, burst_bytes=None if rate is None else args.link_burst))
    return out


def network_name(rate_bps: float | None) -> str:
    if rate_bps is None:
        return "none"
    for unit, scale in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if rate_bps >= scale and rate_bps % scale == 0:
            return f"{int(rate_bps // scale)}{unit}"
    return f"{int(rate_bps)}bit"


def record(point: Point, seconds: float) -> dict:
    """One JSON row, with the bench's field names where they apply."""
    nbytes = point.nbytes
    num_aggregators = point.shards if point.algo in bounds.SPARCOLL_ALGOS else None
    bound = bounds.link_bytes(point.algo, workers=point.workers, nbytes=nbytes, density=point.density,
                              union_density=point.union, nblocks=point.nblocks,
                              aggregators=point.aggregators, num_aggregators=num_aggregators)
    bound_s = None if point.rate_bps is None else bounds.seconds(bound, point.rate_bps)
    return {"algo": point.algo, "input": "dense", "workers": point.workers,
            "aggregators": point.aggregators if point.algo in bounds.SPARCOLL_ALGOS else None,
            "num_aggregators": num_aggregators, "numel": point.numel, "block_size": point.block_size,
            "density": point.density, "union_density": point.union, "overlap": point.overlap,
            "network": network_name(point.rate_bps),
            "rate_bps": point.rate_bps, "link_burst_bytes": point.burst_bytes, "cores": point.cores,
            "credits": point.credits if point.algo in bounds.SPARCOLL_ALGOS else None, "predicted_s": seconds,
            "lower_bound_bytes": bound, "lower_bound_s": bound_s,
            "ratio_to_bound": None if bound_s is None else seconds / bound_s, "speedup_vs_ring": None}


def add_speedups(records: list[dict]) -> None:
    ring = {(r["network"], r["workers"], r["density"]): r["predicted_s"] for r in records if r["algo"] == "ring"}
    for r in records:
        base = ring.get((r["network"], r["workers"], r["density"]))
        r["speedup_vs_ring"] = None if base is None else base / r["predicted_s"]


def table(records: list[dict]) -> str:
    header = f"{'network':>8} {'algo':<10} {'aggregators':<11} {'workers':>7} {'density':>8} " \
             f"{'predicted ms':>13} {'bound ms':>9} {'x bound':>8} {'vs ring':>8}"
    lines = [header, "-" * len(header)]
    for r in records:
        def fmt(value, spec):
            return "-" if value is None else format(value, spec)
        lines.append(f"{r['network']:>8} {r['algo']:<10} {r['aggregators'] or '-':<11} {r['workers']:>7} "
                     f"{r['density']:>8g} {r['predicted_s'] * 1e3:>13.2f} "
                     f"{fmt(r['lower_bound_s'] and r['lower_bound_s'] * 1e3, '9.2f'):>9} "
                     f"{fmt(r['ratio_to_bound'], '8.2f'):>8} {fmt(r['speedup_vs_ring'], '8.2f'):>8}")
    return "\n".join(lines)


def plot(records: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    networks = list(dict.fromkeys(r["network"] for r in records))
    densities = list(dict.fromkeys(r["density"] for r in records))
    fig, axes = plt.subplots(len(densities), len(networks), squeeze=False,
                             figsize=(4.2 * len(networks), 3.2 * len(densities)))
    for (i, density), (j, network) in itertools.product(enumerate(densities), enumerate(networks)):
        ax = axes[i][j]
        rows = [r for r in records if r["network"] == network and r["density"] == density]
        for key in dict.fromkeys((r["algo"], r["aggregators"]) for r in rows):
            line = sorted((r["workers"], r["predicted_s"] * 1e3) for r in rows if (r["algo"], r["aggregators"]) == key)
            label = key[0] if key[1] is None else f"{key[0]} ({key[1]})"
            ax.plot(*zip(*line), marker="o", markersize=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{network}, density {density:g}", fontsize=9)
        ax.set_xlabel("workers")
        ax.set_ylabel("predicted ms")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    try:
        check_output_path(args.calibrate, "--calibrate")
        check_output_path(args.json, "--json", keeps={"--costs": args.costs})
        check_figure_path(args.plot, "--plot", keeps={"--costs": args.costs, "--json": args.json})
    except ValueError as exc:
        print(f"sparcoll simulate: {exc}", file=sys.stderr)
        return 2
    if args.calibrate:
        from .calibrate import calibrate_median
        try:    # its goodput stands in where the link's cannot be measured (no network emulation)
            current = Costs.load(args.costs)
        except (OSError, ValueError) as exc:
            print(f"sparcoll simulate: --costs {args.costs}: {exc}; --calibrate takes the link's goodput from "
                  f"it where it cannot measure one (no network emulation here); a file you name must be readable: "
                  f"fix it, or leave --costs out", file=sys.stderr)
            return 2
        try:
            costs = calibrate_median(CALIBRATION_ROUNDS, default_goodput=current.goodput,
                                     cores=os.cpu_count() or 1, log=lambda line: print(line, file=sys.stderr))
        except RuntimeError as exc:       # a bench run that failed or did not finish
            print(f"sparcoll simulate: calibration failed: {exc}", file=sys.stderr)
            return 1
        costs.save(args.calibrate)
        print(f"wrote {args.calibrate}")
        return 0
    try:
        check(args)
        costs = Costs.load(args.costs)
        wanted = points(args)
    except (OSError, ValueError) as exc:
        print(f"sparcoll simulate: {exc}", file=sys.stderr)
        return 2
    records = [record(point, predict(point, costs)) for point in wanted]
    add_speedups(records)
    print(table(records))
    if args.json:
        write_json(records, args.json)
    if args.plot:
        cores = "every host its own cores" if args.cores is None else f"{args.cores} cores shared"
        plot(records, args.plot, f"sparcoll simulate: {format_count(args.numel)} float32, {cores}")
    return 0
