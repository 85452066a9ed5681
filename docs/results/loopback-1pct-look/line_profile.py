"""One-off: rank 0's main thread under line_profiler (installed outside the project, at /tmp/lp) over 40
calls of job.py's job, the functions named as module:Class.method.
    PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 line_profile.py \
        algorithm:Chooser.densities worker:WorkerJob._stream"""
import importlib
import statistics
import sys

import torch.distributed as dist

import job

sys.path.insert(0, "/tmp/lp")
from line_profiler import LineProfiler  # noqa: E402

comm, loop = job.start()
before = loop(40)
profiler = LineProfiler()
for target in sys.argv[1:]:
    module, path = target.split(":")
    owner = importlib.import_module(f"sparcoll.{module}")
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    setattr(owner, name, profiler(getattr(owner, name)))
during = loop(40)
if dist.get_rank() == 0:
    profiler.print_stats(output_unit=1e-3, stripzeros=True)
    print("median ms before / profiled", statistics.median(before) * 1e3, statistics.median(during) * 1e3)
comm.close()
