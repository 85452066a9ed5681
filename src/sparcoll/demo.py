"""`sparcoll demo`: the bench harness with a preset that runs anywhere in about a minute.

Four worker processes on loopback; sparcoll's block-sparse allreduce next to gloo's dense all_reduce at
several block densities; a table on stdout, JSON and a PNG plot in --out."""
from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", default="4", help="worker processes (default 4)")
    parser.add_argument("--numel", default="16M", help="float32 elements per tensor (default 16M)")
    parser.add_argument("--density", default="0.01,0.1,1", help="block densities (default 0.01,0.1,1)")
    parser.add_argument("--repeat", default="5", help="timed repetitions per point (default 5)")
    parser.add_argument("--out", default="out", help="folder for demo.json and demo.png (default out)")


def run(args: argparse.Namespace) -> int:
    from .bench import command as bench_command

    os.makedirs(args.out, exist_ok=True)
    parser = argparse.ArgumentParser(prog="sparcoll demo")
    bench_command.add_arguments(parser)
    bench_args = parser.parse_args([
        "--workers", args.workers, "--numel", args.numel, "--density", args.density,
        "--algos", "sparcoll,ring", "--network", "none", "--repeat", args.repeat,
        "--json", os.path.join(args.out, "demo.json"), "--plot", os.path.join(args.out, "demo.png"),
    ])
    return bench_command.run(bench_args)
