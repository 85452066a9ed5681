import sys
from sparcoll.bench.launch import Job, run_job
if __name__ == "__main__":
    run_job(Job(4, sys.argv[1], 0, {"timeout": 60}, 120, worker="tlworker"), print)
