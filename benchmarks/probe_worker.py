"""A probe's worker process (probe_job.probe_events starts it as a module): the `body` of the module
`probe` on PYTHONPATH, the probe's own directory under docs/results/."""
from sparcoll.bench.worker import exit_process, run_worker

from probe import body

if __name__ == "__main__":
    exit_process(run_worker(None, body))
