import sys, time, torch, numpy as np
sys.path.insert(0, sys.argv[1])
from sparcoll.blocks import SparseBlocks
torch.set_num_threads(1)
def case(rows, width, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, rows, (1, n), generator=g)
    coo = torch.sparse_coo_tensor(idx, torch.randn(n, width, generator=g), (rows, width)).coalesce()
    sb = SparseBlocks(coo, 16 if width < 16 else width)
    def run():
        sb._results = []
        sb.scatter(sb.indices, sb.data)
        return sb.finish()
    run()
    t = time.perf_counter()
    for _ in range(50): out = run()
    return (time.perf_counter() - t) / 50 * 1e3, out._nnz(), coo._nnz()
for name, args in (("ncf-like 8-wide", (200_000, 8, 30000)), ("deeplight 1-wide", (1_058_073, 1, 6500)), ("1-wide dense-ish", (100_000, 1, 60000))):
    print(sys.argv[1].split('/')[3], name, "ms %.3f listed %d stored %d" % case(*args))
