"""The probe's worker process (the launcher runs it as a module: PYTHONPATH must hold this directory)."""
from sparcoll.bench.worker import exit_process, run_worker

from probe import body

if __name__ == "__main__":
    exit_process(run_worker(None, body))
