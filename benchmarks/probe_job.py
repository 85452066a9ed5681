"""One job of a probe's workers (probe_worker.py: the body of the module `probe` on PYTHONPATH), with the
events its rank 0 emits of one kind: what the one-off probes under docs/results/ share."""
from __future__ import annotations


def probe_events(config: dict, workers: int = 4, network: str = "1gbit",
                 kind: str = "probe") -> tuple[int, list[dict]]:
    """The job's exit status and its events whose "event" is `kind`."""
    from sparcoll.bench.launch import Job, run_job, run_jobs
    found: list[dict] = []

    def job(_advance) -> None:
        run_job(Job(workers, network, 0, config, config["timeout"], worker="probe_worker"),
                lambda event: found.append(event) if event.get("event") == kind else None)
    return run_jobs(kind, 1, job), found


def run_probe(report, config: dict | None = None) -> int:
    """A probe's command line: `--network` (default 1gbit) and `--workers` (default 4), one job of the
    probe with `config` (the worker's timeout at least), each event printed as JSON and then by
    `report(event)`; the job's exit status."""
    import argparse
    import json
    parser = argparse.ArgumentParser()
    parser.add_argument("--network", default="1gbit")
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    status, found = probe_events({"timeout": 300, **(config or {})}, args.workers, args.network)
    for event in found:
        print(json.dumps(event))
        report(event)
    return status
