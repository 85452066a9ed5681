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
