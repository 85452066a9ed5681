"""One-off: which path sparcoll's chooser keeps for a dense 16M kind, 2 ranks on loopback; and its trial times."""
import sys, time, torch, torch.distributed as dist, sparcoll
dist.init_process_group("gloo")
r = dist.get_rank()
comm = sparcoll.init()
src = torch.randn(16 << 20)
for i in range(10):
    t = src.clone(); dist.barrier(); comm.allreduce(t)
st = comm._engine.chooser._kinds
if r == 0:
    for k, v in st.items():
        print("CHOSEN", v.chosen.value if v.chosen else None, {p.value: [round(x * 1e3, 1) for x in ts] for p, ts in v.times.items()}, flush=True)
comm.close(); dist.destroy_process_group()
