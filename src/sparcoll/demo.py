"""`sparcoll demo`: what sparcoll gains over gloo, in about a minute, in the setting it is built for.

Four workers. Where the machine allows it (root, iproute2's `tc`), each on its own emulated host behind
a 1 Gbit/s link, where the network is the bottleneck; otherwise on loopback, where the four processes
share this machine's cores and dense data is CPU-bound (said so on screen). Two parts: sparcoll as
users get it (algorithm "auto"), and forced onto its block-sparse allreduce, next to gloo's ring at
several block densities (the bench harness: a table,
JSON and a PNG plot in --out, and a one-line verdict per density), then a few steps of the ncf
recommendation model trained with DDP on sparcoll next to DDP on gloo (step time, compute and
communication per step, loss)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from .bench.sizes import comma_list, count_argument

BLOCK = 256     # the bench's default block size, which the demo runs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--network", default="auto", type=lambda text: text.strip().lower(),
                        help="auto: an emulated 1gbit network where root and tc allow it, else loopback "
                             "(default); or a link rate such as 1gbit, or none (loopback)")
    parser.add_argument("--workers", default=4, type=_at_least(2), help="worker processes (default 4)")
    parser.add_argument("--numel", default="4M", type=_whole_blocks,
                        help="float32 elements per tensor, a multiple of 256 (default 4M)")
    parser.add_argument("--density", default="0.01,0.1,1", type=comma_list(float, unique=True),
                        help="block densities (default 0.01,0.1,1)")
    parser.add_argument("--repeat", default=5, type=_at_least(1), help="timed repetitions per point (default 5)")
    parser.add_argument("--steps", type=int, default=30,
                        help="ncf training steps per run; 0 skips training (default 30)")
    parser.add_argument("--out", default="out", help="folder for demo.json, demo.png and "
                                                     "demo-train.json (default out)")


def _whole_blocks(text: str) -> int:
    """An argparse type: a count (4M, 65536) of whole blocks of the demo's 256 elements."""
    value = count_argument(text)
    if value % BLOCK:
        raise argparse.ArgumentTypeError(f"{value}: a multiple of {BLOCK} (the demo's block size)")
    return value


def _at_least(least: int):
    """An argparse type: one whole number of at least `least` (the demo runs one setting, not a sweep)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number {text!r}: one whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value}: at least {least}")
        return value
    return parse


def choose_network(requested: str, workers: int = 4) -> tuple[str, str]:
    """(network, why): the emulated 1 Gbit/s network when `auto` and the machine allows it."""
    from .bench.netns import netem_problems

    if requested == "none":
        return requested, "loopback, as asked (--network none): the workers share this machine's cores"
    if requested != "auto":
        return requested, f"an emulated {requested} network, as asked (--network {requested})"
    problems = netem_problems()
    if not problems:
        return "1gbit", (f"{workers} emulated hosts, each behind a 1 Gbit/s link (network namespaces, tc "
                         "tbf): the network is the bottleneck, the setting sparcoll is built for")
    return "none", (f"loopback (an emulated network needs root and iproute2: "
                    f"{'; '.join(problems)}). On loopback the network is never the bottleneck and "
                    f"all workers share this machine's cores, so dense data is CPU-bound; "
                    f"sparcoll's docs/benchmarks.md has the figures at 1 Gbit/s")


def verdicts(path: str) -> list[str]:
    """One line per density: sparcoll's speedup over gloo's ring in this run, as users get it (it
    may send dense data through the ring itself) and with its sparse AllReduce forced."""
    with open(path) as f:
        records = [r for r in json.load(f) if r["input"] == "dense"]
    forced = {r["density"]: r["speedup_vs_ring"] for r in records if r["algo"] == "sparse"}
    return [f"  block density {r['density'] * 100:>4g}%: sparcoll {r['speedup_vs_ring']:.2f}x as fast as "
            f"gloo's ring all_reduce (its sparse AllReduce alone: {forced[r['density']]:.2f}x)"
            for r in records if r["algo"] == "sparcoll"]


def run(args: argparse.Namespace) -> int:
    from .bench import command as bench_command
    from .train import command as train_command

    made = not os.path.isdir(args.out)
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as exc:      # a file of that name, a directory it cannot write in
        print(f"sparcoll demo: error: --out {args.out}: cannot make that directory ({exc.strerror})",
              file=sys.stderr)
        return 2
    network, why = choose_network(args.network, args.workers)
    print(f"sparcoll demo: {why}.", flush=True)
    bench = argparse.ArgumentParser(prog="sparcoll demo")
    bench_command.add_arguments(bench)
    result_path = os.path.join(args.out, "demo.json")
    status = bench_command.run(bench.parse_args([
        "--workers", str(args.workers), "--numel", str(args.numel), "--density", ",".join(map(str, args.density)),
        "--algos", "sparcoll,sparse,ring", "--network", network, "--repeat", str(args.repeat),
        "--json", result_path, "--plot", os.path.join(args.out, "demo.png")]), prog="sparcoll demo")
    if status == 2 and made:        # bad arguments: no empty folder left behind
        shutil.rmtree(args.out, ignore_errors=True)
    if status != 0:
        return status
    print("\n".join(["", "At a glance:", *verdicts(result_path)]), flush=True)
    if args.steps <= 0:
        return 0
    print(f"\nTraining ncf (a recommendation model with embedding tables) for {args.steps} steps "
          f"with DDP on sparcoll, then DDP on gloo:", flush=True)
    train = argparse.ArgumentParser(prog="sparcoll demo")
    train_command.add_arguments(train)
    train_path = os.path.join(args.out, "demo-train.json")
    status = train_command.run(train.parse_args([
        "--workload", "ncf", "--compare", "--steps", str(args.steps), "--workers", str(args.workers),
        "--network", network, "--json", train_path]))
    if status == 0:
        print(communication_share(train_path), flush=True)
        print(f"Results in {os.path.join(args.out, '')}: demo.json, demo.png (the plot), demo-train.json.",
              flush=True)
    return status


def communication_share(path: str) -> str:
    """What there was to win: the share of DDP-on-gloo's step spent communicating."""
    with open(path) as f:
        ddp = next(r for r in json.load(f)["runs"] if r["comm"] == "ddp")
    return (f"DDP on gloo spent {ddp['comm_s'] / ddp['step_s']:.0%} of each step communicating "
            f"({ddp['comm_s'] * 1e3:.0f} of {ddp['step_s'] * 1e3:.0f} ms): that is what sparcoll "
            f"can win.")
