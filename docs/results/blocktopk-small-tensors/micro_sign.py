import time, torch, statistics
from sparcoll.compress import Reducer
torch.set_num_threads(1)
for spec in ("efsignsgd", "onebit", "terngrad", "signsgd"):
    out = []
    for numel in (384, 4096, 147456):
        r = Reducer(spec)
        t = torch.randn(numel)
        op = (lambda: r.compress(t, key=1)) if r.splits else (lambda: r.reduce(t, key=1))
        for _ in range(30): op()
        ts = []
        for _ in range(7):
            c = time.thread_time()
            for _ in range(200): op()
            ts.append((time.thread_time() - c) / 200 * 1e6)
        out.append(f"{statistics.median(ts):6.1f}")
    print(f"{spec:10} {'compress' if Reducer(spec).splits else 'reduce  '}", "  ".join(out), "us (384, 4096, 147456 elements)")
