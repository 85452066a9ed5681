"""The options `sparcoll bench` and `sparcoll simulate` share, checked by the same code: simulate predicts
what bench measures, so an option means the same in both and is refused alike (simulate once took a
--link-burst of 1 byte, a --numel of 1000 it then simulated as 768 elements, and a --num-aggregators
without dedicated aggregators, all of which bench refuses or ignores)."""
from __future__ import annotations

import argparse

from sparcoll.bench.netem import check_link_burst
from sparcoll.wire import MAX_BLOCK_SIZE

AGGREGATORS = ("colocated", "dedicated")


def check_shared(args: argparse.Namespace, layouts: list[str], aggregated: bool, network: str) -> None:
    """A ValueError naming the first shared option that is wrong: --workers, --numel, --block-size,
    --density, --overlap, the aggregator `layouts` asked for (`aggregated`: an algorithm of --algos has
    aggregators, sparse or sparcoll) and --num-aggregators, and --link-burst for `network` ("none": no
    link is shaped)."""
    if min(args.workers) < 2:
        raise ValueError("--workers: an allreduce needs 2 workers at least")
    if not 1 <= args.block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"--block-size must be 1 to {MAX_BLOCK_SIZE}, got {args.block_size}")
    if args.numel % args.block_size:
        raise ValueError(f"--numel {args.numel} must be a multiple of --block-size {args.block_size}")
    if not all(0 < d <= 1 for d in args.density):
        raise ValueError("--density values must be in (0, 1]")
    if not 0 <= args.overlap <= 1:
        raise ValueError("--overlap must be in [0, 1]")
    unknown = [layout for layout in layouts if layout not in AGGREGATORS]
    if unknown:
        raise ValueError(f"--aggregators {','.join(unknown)}: colocated or dedicated")
    if "dedicated" in layouts and not aggregated:
        raise ValueError("--aggregators dedicated: only sparcoll's algorithms (sparse, sparcoll) have aggregators, "
                         "and --algos names neither")
    if args.num_aggregators is not None:
        if args.num_aggregators < 1:
            raise ValueError("--num-aggregators must be >= 1")
        if "dedicated" not in layouts:
            raise ValueError("--num-aggregators counts dedicated aggregators: give --aggregators dedicated")
    check_link_burst(args.link_burst, network)
