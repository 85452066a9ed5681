"""`sparcoll simulate`'s predictions next to measured runs of `sparcoll bench` (the *-colocated.json and
*-dedicated.json files of benchmarks/run_simulate_validation.sh), as a markdown table and JSON.

    .venv/bin/python benchmarks/simulate_validate.py docs/results/simulate [--costs PATH]

Every measured point is predicted with the same inputs: workers, numel, the measured union density, the
link rate and its token bucket, the layout, sparcoll's credits (records made before the bench wrote
them: the default), and this machine's cores shared by every emulated host.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics

from sparcoll.bench.netem import parse_rate
from sparcoll.options import DEFAULT_CREDITS
from sparcoll.simulate.costs import DEFAULT_PATH, Costs
from sparcoll.simulate.model import ALGOS, Point, predict

CORES = 2          # the machine the measurements ran on
TOLERANCE = 0.10


def point_of(record: dict, cores: int) -> Point:
    dedicated = record["aggregators"] == "dedicated"
    rate = parse_rate(record["network"])
    return Point(record["algo"], record["workers"], record["numel"], record["density_actual"],
                 float(rate), aggregators="dedicated" if dedicated else "colocated",
                 num_aggregators=record["num_aggregators"] if dedicated else None,
                 union_density=record["union_density"], cores=cores, block_size=record["block_size"],
                 burst_bytes=record["link_burst_bytes"], credits=record.get("credits") or DEFAULT_CREDITS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--costs", default=str(DEFAULT_PATH))
    parser.add_argument("--cores", type=int, default=CORES)
    args = parser.parse_args()
    costs = Costs.load(args.costs)
    rows = []
    measured = [path for layout in ("colocated", "dedicated")
                for path in glob.glob(os.path.join(args.directory, f"*-{layout}.json"))]
    for path in sorted(measured):
        with open(path) as f:
            records = json.load(f)
        for r in records:
            if r["input"] != "dense" or r["algo"] not in ALGOS:
                continue
            predicted = predict(point_of(r, args.cores), costs)
            rows.append({"network": r["network"], "aggregators": r["aggregators"] or "-", "algo": r["algo"],
                         "workers": r["workers"], "density": r["density"], "measured_s": r["median_s"],
                         "p10_s": r["p10_s"], "p90_s": r["p90_s"], "predicted_s": predicted,
                         "error": predicted / r["median_s"] - 1})
    densities = sorted({r["density"] for r in rows})
    print("| network | aggregators | algo | workers | " + " | ".join(
        f"{d:g}: measured, predicted ms" for d in densities) + " |")
    print("|---|---|---|---|" + "---|" * len(densities))
    lines = {}
    for r in rows:
        key = (r["network"], r["aggregators"], r["algo"], r["workers"])
        mark = "" if abs(r["error"]) <= TOLERANCE else " **miss**"
        lines.setdefault(key, {})[r["density"]] = (f"{r['measured_s'] * 1e3:.1f}, {r['predicted_s'] * 1e3:.1f} "
                                                   f"({r['error'] * 100:+.0f}%{mark})")
    for key, cells in lines.items():
        print("| " + " | ".join(str(k) for k in key) + " | "
              + " | ".join(cells.get(d, "-") for d in densities) + " |")
    print()
    groups = {}
    for r in rows:
        groups.setdefault((r["algo"], r["aggregators"]), []).append(r)
    for (algo, layout), members in [(("all", ""), rows)] + sorted(groups.items()):
        within = sum(abs(r["error"]) <= TOLERANCE for r in members)
        name = algo if not layout or layout == "-" else f"{algo} {layout}"
        print(f"- {name}: {within} of {len(members)} points within {TOLERANCE:.0%}, median |error| "
              f"{statistics.median(abs(r['error']) for r in members) * 100:.1f}%")
    with open(os.path.join(args.directory, "validation.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
