"""The multi-host comparison of benchmarks/run_multihost.sh as a markdown table: per point, the range of
the rounds' medians with workers started directly and by torchrun agents, and torchrun / direct per round.

    python3 benchmarks/multihost_summary.py docs/results/multihost
"""
import glob
import json
import os
import sys
from collections import defaultdict


def main(directory: str) -> None:
    medians = defaultdict(dict)   # (layout, algo, input, density) -> {(launcher, round): median ms}
    for path in sorted(glob.glob(os.path.join(directory, "*-r*.json"))):
        layout, launcher, rnd = os.path.basename(path)[:-len(".json")].split("-")
        for r in json.load(open(path)):
            medians[layout, r["algo"], r["input"], r["density"]][launcher, rnd] = r["median_s"] * 1e3
    print("| aggregators | algo | density | direct ms | torchrun ms | torchrun / direct per round |")
    print("|---|---|---|---|---|---|")
    for (layout, algo, kind, density), runs in sorted(medians.items()):
        rounds = sorted({rnd for _, rnd in runs})
        direct = [runs[("direct", r)] for r in rounds if ("direct", r) in runs]
        torchrun = [runs[("torchrun", r)] for r in rounds if ("torchrun", r) in runs]
        ratios = [runs[("torchrun", r)] / runs[("direct", r)] for r in rounds
                  if ("direct", r) in runs and ("torchrun", r) in runs]
        label = algo if kind == "dense" else f"{algo} ({kind})"
        print(f"| {layout} | {label} | {density:g} | {min(direct):.1f}-{max(direct):.1f} | "
              f"{min(torchrun):.1f}-{max(torchrun):.1f} | {', '.join(f'{x:.2f}' for x in ratios)} |")


if __name__ == "__main__":
    main(sys.argv[1])
