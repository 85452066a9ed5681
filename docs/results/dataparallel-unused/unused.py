"""DataParallel when one rank leaves a branch unused (data-dependent control flow): see README.md."""
import os, sys, time, torch, torch.distributed as dist
from torch import nn
import sparcoll, sparcoll.torch
dist.init_process_group("gloo")
r = dist.get_rank()
comm = sparcoll.init()
class M(nn.Module):
    def __init__(self):
        super().__init__(); torch.manual_seed(0)
        self.a = nn.Linear(8, 8); self.b = nn.Linear(8, 8); self.c = nn.Linear(8, 1)
    def forward(self, x, use_b):
        h = self.a(x)
        if use_b: h = self.b(h)
        return self.c(h)
dp = sparcoll.torch.DataParallel(M(), comm=comm, strategy=sys.argv[1], timeout=20,
                                 find_unused_parameters=sys.argv[2:] == ["find_unused"])
x = torch.randn(4, 8)
t = time.monotonic()
try:
    for step in range(3):
        dp(x, use_b=(r == 0 or step == 0)).sum().backward()
        print(r, "step", step, "ok; b.weight's gradient sum", dp.module.b.weight.grad.sum().item(), flush=True)
        dp.module.zero_grad()
except Exception as exc:
    print(r, "error after %.1f s:" % (time.monotonic() - t), type(exc).__name__, str(exc)[:300], flush=True)
dp.close(); comm.close()
