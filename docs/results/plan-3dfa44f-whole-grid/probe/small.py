import time, torch, statistics
from sparcoll.compress import Reducer
torch.set_num_threads(1)
sizes = {"out.bias": 1, "out.weight": 9, "mlp.4.bias": 8, "mlp.4.weight": 128, "mlp.2.bias": 16, "mlp.2.weight": 512, "mlp.0.bias": 32, "mlp.0.weight": 2048, "x4096": 4096, "x65536": 65536}
for spec in ("blocktopk:0.01", "efsignsgd", "fp16"):
    r = Reducer(spec)
    out = []
    for name, n in sizes.items():
        x = torch.randn(n)
        for _ in range(5): r.compress(x, key=name)
        ts = []
        for _ in range(200):
            c = time.thread_time(); r.compress(x, key=name); ts.append(time.thread_time() - c)
        out.append(f"{name} {statistics.median(ts)*1e3:.3f}")
    print(spec, "; ".join(out))
