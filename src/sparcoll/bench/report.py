"""Benchmark records (one per worker count, algorithm variant and density), their table and JSON file.

Bandwidths follow nccl-tests for allreduce, in GB/s (1e9 bytes/s): algbw = N / time with N = numel x
itemsize; busbw = algbw x 2(n-1)/n, the per-link rate a ring would need, comparable across algorithms
and worker counts.
"""
from __future__ import annotations

import io
import json
import statistics
from dataclasses import dataclass

import numpy as np
from rich import box
from rich.console import Console
from rich.table import Table

from sparcoll.bench import bounds
from sparcoll.bench.netem import tbf_burst_bytes
from sparcoll.bench.patterns import InputSpec
from sparcoll.bench.sizes import format_count

ITEMSIZE = 4  # float32
#: Where algorithms other than sparcoll reduce (sparcoll follows --aggregators).
FIXED_AGGREGATORS = {"ps": "colocated"}
#: rich's SIMPLE_HEAD (only a rule under the header) in ASCII: the table goes to logs and files of any
#: encoding.
HEADER_RULE = box.Box("    \n    \n -- \n    \n    \n    \n    \n    \n", ascii=True)


@dataclass(frozen=True)
class Setup:
    """Run-wide parameters of one worker count."""
    network: str            # "none" or a tc rate
    rate_bps: int | None    # None on loopback
    aggregators: str        # colocated or dedicated (sparcoll)
    num_aggregators: int    # dedicated aggregators (sparcoll)
    launcher: str = "direct"  # direct, or torchrun (an agent per host)
    link_burst: int | None = None  # the links' token bucket, None: netem's default for the rate
    cores: int | None = None    # CPUs the hosts share (every host of a bench runs on this machine)


def make_record(result: dict, spec: InputSpec, setup: Setup, union_density: float,
                block_size: int | None = None) -> dict:
    """The record of one result event of a worker (see worker.py); speedup_vs_ring is added later."""
    n, times = spec.workers, result["times_s"]
    nbytes = spec.numel * ITEMSIZE
    median = statistics.median(times)
    p10, p90 = np.percentile(times, [10, 90]).tolist()
    algo = result["algo"]
    if algo in bounds.SPARCOLL_ALGOS:
        aggregators = setup.aggregators
        num_aggregators = setup.num_aggregators if aggregators == "dedicated" else n
    else:
        aggregators = FIXED_AGGREGATORS.get(algo)
        num_aggregators = n if aggregators else None
    density = spec.blocks_per_worker / spec.nblocks
    bound = bounds.link_bytes(algo, workers=n, nbytes=nbytes, density=density, union_density=union_density,
                              nblocks=spec.nblocks, aggregators=aggregators, num_aggregators=num_aggregators,
                              input=result["input"], itemsize=ITEMSIZE)
    if result["bytes_source"]:
        source = result["bytes_source"]
        sent = statistics.mean(result["bytes_sent"])
        received = statistics.mean(result["bytes_received"])
    else:  # a gloo baseline on loopback: its known, symmetric traffic
        source, sent, received = "model", bound, bound
    bound_s = None if setup.rate_bps is None else bounds.seconds(bound, setup.rate_bps)
    algbw = nbytes / median / 1e9
    cpu = statistics.median(result["cpu_s"])
    return {
        "algo": algo, "input": result["input"], "workers": n, "aggregators": aggregators,
        "num_aggregators": num_aggregators, "numel": spec.numel,
        "block_size": spec.block_size if block_size is None else block_size, "row_width": spec.block_size,
        "dtype": "float32", "density": spec.density, "density_actual": density, "union_density": union_density,
        "overlap": spec.overlap, "network": setup.network, "launcher": setup.launcher, "seed": spec.seed,
        "repeat": len(times),
        "median_s": median, "p10_s": p10, "p90_s": p90, "times_s": times,
        "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (n - 1) / n,
        "bytes_sent_per_worker": sent, "bytes_received_per_worker": received, "bytes_source": source,
        "lower_bound_bytes": bound, "lower_bound_s": bound_s,
        # tbf lets this many bytes through at once: transfers of about this size can beat the bound
        "link_burst_bytes": None if setup.rate_bps is None else setup.link_burst or tbf_burst_bytes(setup.rate_bps),
        # sparcoll's messages in flight per stream ($SPARCOLL_CREDITS); None for the others
        "credits": result["credits"],
        "ratio_to_bound": None if bound_s is None else median / bound_s,
        # the workers' CPU seconds per collective, summed over ranks (median), and that over the
        # cores: no schedule of that work on them ends sooner (a floor besides the link's)
        "cpu_s": cpu, "cpu_floor_s": cpu / setup.cores if setup.cores else None,
        "speedup_vs_ring": None,
    }


def add_speedups(records: list[dict]) -> None:
    """speedup_vs_ring = the ring's median / this median, at the same worker count and density."""
    ring = {(r["workers"], r["density"]): r["median_s"] for r in records if r["algo"] == "ring"}
    for r in records:
        base = ring.get((r["workers"], r["density"]))
        r["speedup_vs_ring"] = None if base is None else base / r["median_s"]


def missing(records: list[dict], workers: list[int], variants: list[tuple[str, str]],
            densities: list[float]) -> list[str]:
    """The configurations of a sweep that have no record, one item per worker count: "3 workers" when
    none of its records is there, else "3 workers (ring at density 1, ps at densities 0.1 and 1)"."""
    done = {(r["workers"], r["algo"], r["input"], r["density"]) for r in records}
    out = []
    for n in workers:
        lacking = {(name, input): [d for d in densities if (n, name, input, d) not in done] for name, input in variants}
        if all(len(ds) == len(densities) for ds in lacking.values()):
            out.append(f"{n} workers")
            continue
        parts = []
        for (name, input), ds in lacking.items():
            if ds:
                listed = f"density {ds[0]:g}" if len(ds) == 1 else \
                    f"densities {', '.join(f'{d:g}' for d in ds[:-1])} and {ds[-1]:g}"
                parts.append(f"{label({'algo': name, 'input': input})} at {listed}")
        if parts:
            out.append(f"{n} workers ({', '.join(parts)})")
    return out


def label(record: dict) -> str:
    return record["algo"] if record["input"] == "dense" else f"{record['algo']} ({record['input']})"


def density_cell(record: dict) -> str:
    """The density asked for, and beside it the one that ran where whole blocks made it differ by more
    than 1% of it (a 64K tensor has 256 blocks: "0.01" runs 3 of them, 0.0117)."""
    asked, ran = record["density"], record["density_actual"]
    return f"{asked:g}" if abs(ran - asked) <= 0.01 * asked else f"{asked:g} (ran {ran:.3g})"


def table(records: list[dict]) -> str:
    """A fixed-width text table of the records (plain text, at its natural width)."""
    def num(value, fmt):
        return "-" if value is None else format(value, fmt)

    header = ("algo", "workers", "density", "median ms", "p10 ms", "p90 ms", "algbw GB/s", "busbw GB/s",
              "MB sent/wkr", "bound ms", "x bound", "cpu ms", "cpu floor ms", "vs ring")
    rows = [(label(r), str(r["workers"]), density_cell(r), num(r["median_s"] * 1e3, ".2f"),
             num(r["p10_s"] * 1e3, ".2f"), num(r["p90_s"] * 1e3, ".2f"), num(r["algbw_gbps"], ".3f"),
             num(r["busbw_gbps"], ".3f"), num(r["bytes_sent_per_worker"] / 1e6, ".3f"),
             num(r["lower_bound_s"] and r["lower_bound_s"] * 1e3, ".2f"), num(r["ratio_to_bound"], ".2f"),
             num(r["cpu_s"] * 1e3, ".2f"), num(r["cpu_floor_s"] and r["cpu_floor_s"] * 1e3, ".2f"),
             num(r["speedup_vs_ring"], ".2f")) for r in records]
    grid = Table(box=HEADER_RULE, show_edge=False, pad_edge=False)
    for i, name in enumerate(header):
        grid.add_column(name, justify="right" if i else "left")
    for row in rows:
        grid.add_row(*row)
    # Cells as they are (no markup, no emoji codes), no styles whatever the environment asks of rich,
    # wide enough never to wrap a cell.
    console = Console(file=io.StringIO(), width=1 << 16, color_system=None, markup=False, emoji=False)
    console.print(grid)
    return console.file.getvalue().rstrip("\n")


def title(records: list[dict]) -> str:
    """What the records have in common, for table and plot titles."""
    first = records[0]
    workers = ",".join(str(w) for w in sorted({r["workers"] for r in records}))
    ours = [r for r in records if r["algo"] in bounds.SPARCOLL_ALGOS]
    rows = f", rows of {first['row_width']}" if first["row_width"] != first["block_size"] else ""
    aggregators = f", sparcoll aggregators {ours[0]['aggregators']}" if ours else ""
    launcher = ", launched by torchrun (an agent per host)" if first.get("launcher") == "torchrun" else ""
    return (f"workers={workers}, network={first['network']}{launcher}, numel={format_count(first['numel'])} float32\n"
            f"block {first['block_size']}{rows}, overlap {first['overlap']:g}{aggregators}")


def write_json(records: list[dict], path: str) -> None:
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
        f.write("\n")
