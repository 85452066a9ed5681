import time, torch, statistics, sys
from sparcoll.compress import Reducer
torch.set_num_threads(1)
for numel in (384, 1152, 1536, 12288, 147456):
    r = Reducer("blocktopk:0.01")
    t = torch.randn(numel)
    for _ in range(50): r.compress(t, key=numel)
    ts = []
    for _ in range(7):
        c = time.thread_time()
        for _ in range(300): r.compress(t, key=numel)
        ts.append((time.thread_time() - c) / 300 * 1e6)
    print(numel, f"{statistics.median(ts):.1f} us")
