"""Decision time of the planner (docs/benchmarks.md): how long `decide.plan` takes for models of 6 to 314
tensors, the workloads as `sparcoll plan` profiled them and a ResNet-101-shaped table of 314 tensors
(ByteComp's largest model; its Python implementation decides it in 179 ms) priced with a profile's
curves, with the small tensors grouped into DataParallel's buckets (what `sparcoll plan` decides on)
and with every tensor a unit of its own (the algorithm's worst case), each with offloading allowed (a
machine with a spare core per worker) and without (this one). Median of 5 decisions, idle machine.

    python3 benchmarks/plan_decision.py PROFILE_DIR... [--json OUT]

A PROFILE_DIR holds W-profile.json files (benchmarks/run_plan.sh; a later directory's profile of the
same workload replaces an earlier one's); the ResNet table takes vgg's curves
(4 workers, 1 Gbit/s) and a backward of 300 ms whose tensors are ready in proportion to their size.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

from sparcoll.plan import decide
from sparcoll.plan.command import choices_of, costing_of, tensors_of, units_of
from sparcoll.plan.costs import Costing, Measured
from sparcoll.plan.options import COMPRESSORS, JobFacts, TensorFacts
from sparcoll.plan.timeline import Step

REPEAT = 5


def resnet101() -> list[tuple[str, tuple]]:
    """ResNet-101's parameters in forward order: stem, 33 bottlenecks (3, 4, 23, 3), classifier."""
    params = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    inplanes = 64
    for stage, (blocks, width) in enumerate(zip((3, 4, 23, 3), (64, 128, 256, 512)), start=1):
        for b in range(blocks):
            prefix = f"layer{stage}.{b}"
            for i, shape in enumerate(((width, inplanes, 1, 1), (width, width, 3, 3), (4 * width, width, 1, 1)), 1):
                params += [(f"{prefix}.conv{i}.weight", shape), (f"{prefix}.bn{i}.weight", (shape[0],)),
                           (f"{prefix}.bn{i}.bias", (shape[0],))]
            if b == 0:
                params += [(f"{prefix}.downsample.0.weight", (4 * width, inplanes, 1, 1)),
                           (f"{prefix}.downsample.1.weight", (4 * width,)), (f"{prefix}.downsample.1.bias", (4 * width,))]
            inplanes = 4 * width
    return params + [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]


def resnet_instance(count: int, backward: float = 0.3) -> tuple[Step, list[Measured]]:
    """The last `count` of ResNet-101's tensors (the first ready in backward), ready in proportion to
    their size over `backward` seconds; the classifier's weight is a linear layer of batch 32."""
    table = list(reversed(resnet101()))[:count]
    numels = [_numel(shape) for _, shape in table]
    total, ready, done = sum(numels), [], 0
    for n in numels:
        done += n
        ready.append(backward * done / total)
    measured = [Measured(TensorFacts(name, n, linear=name == "fc.weight"), shape, 32 if name == "fc.weight" else 0,
                         1.0, 1.0) for (name, shape), n in zip(table, numels)]
    return Step(tuple(ready), backward, 0.01), measured


def _numel(shape: tuple) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def decision_ms(step: Step, measured: list[Measured], costing: Costing, grouped: bool,
                compressors, offload: bool) -> tuple[float, int]:
    groups = [[i] for i in range(len(measured))]
    units = measured
    if grouped:
        step, units, groups = units_of(step, measured)
    tensors = choices_of(units, groups, measured, costing, compressors, JobFacts(offload_core=offload))
    times = []
    for _ in range(REPEAT):
        start = time.perf_counter()
        decide.plan(step, tensors)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times), len(units)


def compressors_of(profile: dict) -> list[str]:
    """The compressors the profile timed (an older profile may lack some), and none."""
    return ["none"] + [c for c in COMPRESSORS if c in profile["fits"]["compress"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profiles", type=Path, nargs="+", help="directories of W-profile.json files")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    profiles = {p.name.removesuffix("-profile.json"): json.loads(p.read_text())
                for d in args.profiles for p in sorted(d.glob("*-profile.json"))}     # a later one wins
    profiles = {name: p for name, p in profiles.items() if "fits" in p}
    for name, profile in profiles.items():
        step, measured = tensors_of(profile)
        costing = costing_of(profile)
        for grouped, offload in itertools.product((True, False), repeat=2):
            ms, units = decision_ms(step, measured, costing, grouped, compressors_of(profile), offload)
            rows.append({"model": name, "tensors": len(measured), "units": units, "grouped": grouped,
                         "offload": offload, "decision_ms": ms})
    base = profiles.get("vgg") or next(iter(profiles.values()))
    costing = costing_of(base)
    for count in (10, 32, 150, 300, 314):
        step, measured = resnet_instance(count)
        for grouped, offload in itertools.product((True, False), repeat=2):
            ms, units = decision_ms(step, measured, costing, grouped, compressors_of(base), offload)
            rows.append({"model": f"resnet101 (last {count})" if count < 314 else "resnet101",
                         "tensors": count, "units": units, "grouped": grouped, "offload": offload,
                         "decision_ms": ms})
    print(f"{'model':<24} {'tensors':>7} {'units':>6} {'grouped':>8} {'offload':>8} {'decision ms':>12}")
    for r in rows:
        print(f"{r['model']:<24} {r['tensors']:>7} {r['units']:>6} {str(r['grouped']):>8} {str(r['offload']):>8} "
              f"{r['decision_ms']:>12.1f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
