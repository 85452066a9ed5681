"""The planner's predictions against steps already measured: each candidate strategy of a
`run_plan.sh` directory (its plan JSON and its measured step in every round) predicted from another
profile of the same workload, both ways the simulator can (timeline.py): every operation taking its
time alone (ByteComp's model, what the decision searches with) and as `sparcoll plan` reports it
(`simulate`: the profile's contention, or where workers share cores the CPU bound and the cores' idle
wait). Prints predicted / measured per
candidate and workload, and with --json writes them. --compress-apart prices each compressor on the
model's own gradients by its time apart from training (`compress_alone`, what profiles before version
20 priced) instead of its time inside backward: what timing it in backward changed, on the same steps.

    python3 benchmarks/contention_predict.py MEASURED_DIR PROFILE_DIR [--compress-apart] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from sparcoll.plan.command import priced_as_stored
from sparcoll.plan.decide import predict
from sparcoll.plan.profiler import fit
from sparcoll.plan.timeline import Simulation


def measured_steps(directory: Path, workload: str) -> dict[str, list[float]]:
    """Each candidate's step time per round: the plan as "planned", the others by plan file name."""
    out: dict[str, list[float]] = {}
    for round_file in sorted(directory.glob(f"{workload}-r*.json")):
        for run in json.loads(round_file.read_text())["runs"]:
            if run["comm"] != "ddp":
                name = "planned" if run["comm"] == "planned" else Path(run["strategy"]).name
                out.setdefault(name, []).append(run["step_s"])
    return out


def compress_apart(points: list[dict]) -> list[dict]:
    """The profile's points with each compressor's time on a model gradient taken apart from training
    where the profile has it (`compress_alone`), not inside backward."""
    apart = {(p["what"], p["tensor"]) for p in points if p["kind"] == "compress_alone"}
    return [{**p, "kind": "compress"} if p["kind"] == "compress_alone" else p for p in points
            if not (p["kind"] == "compress" and (p["what"], p.get("tensor")) in apart)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("measured", type=Path, help="a run_plan.sh output directory")
    parser.add_argument("profiles", type=Path, help="a directory of W-profile.json files")
    parser.add_argument("--compress-apart", action="store_true",
                        help="price compressors on the model's gradients by their time apart from training")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    for profile_file in sorted(args.profiles.glob("*-profile.json")):
        workload = profile_file.name.removesuffix("-profile.json")
        steps = measured_steps(args.measured, workload)
        if not steps:
            continue
        profile = json.loads(profile_file.read_text())
        points = compress_apart(profile["points"]) if args.compress_apart else profile["points"]
        profile["fits"] = fit(points)        # as this version fits the stored points
        forward = profile["model"]["forward"]
        print(f"{workload}: predicted / measured (measured: median of {len(next(iter(steps.values())))} rounds)")
        for name, times in steps.items():
            plan = json.loads((args.measured / (f"{workload}-plan.json" if name == "planned" else name)).read_text())
            unit_step, unit_tensors, unit_chosen = priced_as_stored(profile, plan)
            alone = forward + Simulation(unit_step, [t.costs[o] for t, o in zip(unit_tensors, unit_chosen)]).iteration
            contended = forward + predict(unit_step, unit_tensors, unit_chosen)
            m = statistics.median(times)
            rows.append({"workload": workload, "candidate": name, "measured_s": m, "alone_s": alone,
                         "contended_s": contended})
            print(f"  {name:38s} measured {1e3 * m:8.1f} ms   alone {alone / m:5.2f}   contended {contended / m:5.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
