"""Each compressor's time on a model's own gradients as a profile measured it inside backward (what
the planner prices, profile version 20) against its time apart from training (`compress_alone`):
one line per compressor and gradient, and the ratio of their sums per compressor.

    python3 benchmarks/compress_in_backward.py PROFILE.json [PROFILE.json ...]
"""
from __future__ import annotations

import json
import sys

from sparcoll.plan.profiler import fit


def main(paths: list[str]) -> int:
    for path in paths:
        fits = fit(json.load(open(path))["points"])
        print(path)
        for spec, apart in fits.get("compress_alone_own", {}).items():
            inside = fits["compress_own"][spec]
            for name, seconds in apart.items():
                print(f"  {spec:16s} {name:28s} in backward {1e3 * inside[name]:7.2f} ms   apart "
                      f"{1e3 * seconds:7.2f} ms   {inside[name] / seconds:5.2f}x")
            print(f"  {spec:16s} {'all of them':28s} {sum(inside.values()) / sum(apart.values()):5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
