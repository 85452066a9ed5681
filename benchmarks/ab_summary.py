"""Summarize benchmarks/run_ab.sh: per configuration, algorithm and density, the median over the rounds
of each commit's median time (with the range) and the range of its speedup over gloo's ring in the
same run.   python3 benchmarks/ab_summary.py OUT_DIR"""
import collections
import glob
import json
import os
import sys


def main(out: str) -> None:
    rows = collections.defaultdict(lambda: collections.defaultdict(list))
    for path in sorted(glob.glob(os.path.join(out, "*-r*-*.json"))):
        version, _, config = os.path.basename(path)[:-5].split("-")
        for r in json.load(open(path)):
            if r["algo"] != "ring":
                name = r["algo"] + (" (coo)" if r["input"] == "coo" else "")
                rows[config, name, r["density"]][version].append(
                    (r["median_s"] * 1e3, r["speedup_vs_ring"]))
    print("| config | algo | density | old ms: median (range) | new ms: median (range) "
          "| old vs ring | new vs ring |")
    print("|---|---|---|---|---|---|---|")
    for (config, name, density), by_version in sorted(rows.items()):
        cells = []
        for version in ("old", "new"):
            ms = sorted(m for m, _ in by_version[version])
            cells.append(f"{ms[len(ms) // 2]:.1f} ({ms[0]:.1f}-{ms[-1]:.1f})" if ms else "-")
        for version in ("old", "new"):
            ratios = sorted(x for _, x in by_version[version])
            cells.append(f"{ratios[0]:.2f}-{ratios[-1]:.2f}" if ratios else "-")
        print(f"| {config} | {name} | {density:g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
