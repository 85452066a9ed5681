"""The Python work of the backend's delegated all_reduce, timed alone in one process (a world of 1, no
peer): microseconds per call of each piece. `OMP_NUM_THREADS=1 .venv/bin/python
docs/results/delegated-check/overhead.py` from the project root."""
import timeit
from datetime import timedelta

import torch
import torch.distributed as dist

from sparcoll.torch.backend import _call_number
from sparcoll.torch.futures import Completion

N = 2000


def microseconds(fn) -> float:
    return round(timeit.timeit(fn, number=N) / N * 1e6, 1)


def completion_over_a_finished_future():
    future = torch.futures.Future()
    completion = Completion([tensor], [future])
    future.set_result(None)
    completion.done.wait()


if __name__ == "__main__":
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))
    tensor, options = torch.zeros(1, dtype=torch.int64), dist.AllreduceOptions()
    print("gloo all_reduce and wait, world of 1:", microseconds(lambda: group.allreduce([tensor], options).wait()))
    print("torch.futures.Future():", microseconds(torch.futures.Future))
    print("Future().then(...):", microseconds(lambda: torch.futures.Future().then(lambda f: f.value())))
    print("_call_number (the fingerprint):", microseconds(lambda: _call_number(options.reduceOp.op, [tensor])))
    print("the check's tensor:", microseconds(lambda: torch.tensor([1.0, 1.0], dtype=torch.float64)))
    print("a Completion over one future that finishes:", microseconds(completion_over_a_finished_future))
