"""Which path "auto" keeps for a dense 4M-float kind over 2 ranks on loopback, after its trials: 12
calls, then rank 0 prints the choice and its own trial times (ms). One run per launch:
    for i in $(seq 16); do OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 \
        docs/results/chooser-retry/choice.py 2>&1 | grep CHOSEN; done
before-16-runs.txt: at d716adc (the chooser as at fa6e0a3)."""
import os, time, torch, torch.distributed as dist
import sparcoll
dist.init_process_group("gloo")
rank = dist.get_rank()
comm = sparcoll.init()
n = int(os.environ.get("NUMEL", 4 << 20))
src = torch.randn(n, generator=torch.Generator().manual_seed(rank)); buf = torch.empty_like(src)
for i in range(12):
    buf.copy_(src); comm.allreduce(buf)
if rank == 0:
    for k, s in comm._engine.chooser._kinds.items():
        print("CHOSEN", s.chosen.value, {a.value: [round(x * 1e3, 1) for x in v[:3]] for a, v in s.times.items()})
comm.close(); dist.destroy_process_group()
