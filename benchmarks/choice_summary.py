"""Summarize benchmarks/run_choice.sh: per configuration and density, the range over the rounds of
sparcoll's speedup over gloo's ring (as users get it, and forced sparse; "-" where a run did not
time that one) and of each one's time against the lower bound of its bytes; runs counts the rounds.
    python3 benchmarks/choice_summary.py OUT_DIR"""
import collections
import glob
import json
import os
import sys


def span(values: list[float], fmt: str = "{:.2f}") -> str:
    values = sorted(v for v in values if v is not None)
    if not values:
        return "-"
    return fmt.format(values[0]) + ("" if len(values) == 1 else "-" + fmt.format(values[-1]))


def main(out: str) -> None:
    rows = collections.defaultdict(lambda: collections.defaultdict(list))
    for path in sorted(glob.glob(os.path.join(out, "*-r*.json"))):
        config = os.path.basename(path).rsplit("-r", 1)[0]
        for r in json.load(open(path)):
            if r["input"] == "dense":
                rows[config, r["density"]][r["algo"]].append(r)
    print("| configuration | density | runs | sparcoll vs ring | sparse vs ring | ring ms "
          "| sparcoll x bound | sparse x bound |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for (config, density), algos in sorted(rows.items()):
        ours, forced, ring = algos["sparcoll"], algos["sparse"], algos["ring"]
        print(f"| {config} | {density:g} | {len(ring)} "
              f"| {span([r['speedup_vs_ring'] for r in ours])} "
              f"| {span([r['speedup_vs_ring'] for r in forced])} "
              f"| {span([r['median_s'] * 1e3 for r in ring], '{:.0f}')} "
              f"| {span([r['ratio_to_bound'] for r in ours])} "
              f"| {span([r['ratio_to_bound'] for r in forced])} |")


if __name__ == "__main__":
    main(sys.argv[1])
