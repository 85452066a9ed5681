"""One-off: nonzero_mask of two versions of blocks.py, alternated, on 16M float32 freshly copied, one core.
    git show a8ca1ca:src/sparcoll/blocks.py > /tmp/blocks_old.py
    PYTHONPATH=src OMP_NUM_THREADS=1 python docs/results/narrow-scan/scan_ab.py 100 16,32,64,256 /tmp/blocks_old.py
(arguments: calls per point, row widths, the old blocks.py; prints the medians)"""
import sys, time, numpy as np, torch, importlib.util
from sparcoll.blocks import nonzero_mask as new
spec = importlib.util.spec_from_file_location("blocks_old", sys.argv[3]); old_mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(old_mod)
old = old_mod.nonzero_mask
torch.set_num_threads(1)
WIDTHS = [int(w) for w in sys.argv[2].split(",")] if len(sys.argv) > 2 else (16, 32, 64, 256)
t = torch.zeros(16 << 20); src = t.clone()
g = torch.Generator().manual_seed(0)
for density in (0.01, 0.1, 1.0):
    for width in WIDTHS:
        rows = t.view(-1, width); n = rows.shape[0]
        src.zero_(); src.view(-1, width)[torch.randperm(n, generator=g)[:int(n*density)]] = 1.0
        res = {"old": [], "new": []}
        for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 20):
            for name, f in (("old", old), ("new", new)) if i % 2 else (("new", new), ("old", old)):
                t.copy_(src); a = time.perf_counter(); m = f(rows); res[name].append(time.perf_counter() - a)
        assert (old(rows) == new(rows)).all()
        print("density %-5g width %4d  old %.2f ms  new %.2f ms" % (density, width, np.median(res["old"])*1e3, np.median(res["new"])*1e3))
