import time
import torch, torch.distributed as dist
from datetime import timedelta
def parts(rank, world):
    import sparcoll.torch  # noqa
    from sparcoll.torch.backend import _backend_of
    from sparcoll.wire import DELEGATED_TAG
    sp = dist.new_group(backend="sparcoll", timeout=timedelta(seconds=60))
    gl = dist.new_group(backend="gloo")
    inner = _backend_of(sp)
    out = []
    def timeit(fn, n=300):
        for _ in range(20):
            fn()
        dist.barrier(group=gl)
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return round((time.perf_counter() - start) / n * 1e3, 3)
    for _ in range(3):
        row = {}
        t = torch.zeros(1, dtype=torch.int64)   # zeros: a sum in place stays put
        row["delegated"] = timeit(lambda: dist.all_reduce(t, group=sp))
        row["inner gloo"] = timeit(lambda: inner.gloo.allreduce([t]).wait())
        c = torch.zeros(2, dtype=torch.float64)
        row["check alone"] = timeit(lambda: inner.comm.allreduce(c, tag=DELEGATED_TAG))
        row["check untagged"] = timeit(lambda: inner.comm.allreduce(c))
        def both():
            w = inner.gloo.allreduce([t])
            inner.comm.allreduce(c, tag=DELEGATED_TAG)
            w.wait()
        row["both, plain"] = timeit(both)
        out.append(row)
    dist.destroy_process_group(sp)
    return out
