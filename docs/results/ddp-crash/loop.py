"""One-off: plain torch DDP on gloo (no sparcoll launcher, fork server or collective): two ranks of
sparcoll's ncf workload (tiny, sparse embeddings), or with MODEL=tables a model of two sparse tables
and an MLP, STEPS steps with an all_gather after each, as sparcoll.train.worker does; workers started
by torch.multiprocessing (spawn: new interpreters); repeated RUNS times or SECONDS. Prints each run's
exit codes (runs/plain-ncf-spawn.log; runs/plain-two-tables-spawn.log with MODEL=tables). WORLD ranks
(2), ncf full size with TINY=0 and BATCH samples a rank (8).
    OMP_NUM_THREADS=1 PYTHONPATH=src python loop.py RUNS STEPS SECONDS"""
import os, sys, time, socket
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.users = nn.Embedding(1000, 16, sparse=True)
        self.items = nn.Embedding(2000, 16, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))
    def forward(self, u, i):
        return self.mlp(torch.cat([self.users(u), self.items(i)], 1)).squeeze(1)

def worker(rank, port, steps, threads):
    import faulthandler; faulthandler.enable()
    torch.manual_seed(0)
    world = int(os.environ.get("WORLD", "2"))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if os.environ.get("MODEL") == "tables":
        g = torch.Generator().manual_seed(rank)
        net = Model()
        batches = iter(lambda: (torch.randint(0, 1000, (8,), generator=g), torch.randint(0, 2000, (8,), generator=g),
                                torch.rand(8, generator=g)), None)
        loss_of = lambda m, b: nn.functional.binary_cross_entropy_with_logits(m(b[0], b[1]), b[2])
    else:
        from sparcoll.workloads import get_workload
        w = get_workload("ncf", tiny=os.environ.get("TINY", "1") == "1", sparse_embeddings=True, seed=0)
        net, batches, loss_of = w.model, w.batches(int(os.environ.get("BATCH", "8")), rank, world, 0), w.loss
    model = DistributedDataParallel(net, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        opt.zero_grad()
        loss = loss_of(model, next(batches))
        loss.backward()
        opt.step()
        rows = [torch.empty(3, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(rows, torch.tensor([loss.item(), 0.0, 0.0], dtype=torch.float64))
    dist.destroy_process_group()
    os._exit(0)

if __name__ == "__main__":
    runs, steps, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    end, fails = time.monotonic() + seconds, 0
    ctx = mp.get_context(os.environ.get("START", "spawn"))
    for run in range(runs):
        if time.monotonic() > end:
            break
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        ps = [ctx.Process(target=worker, args=(r, port, steps, 2)) for r in range(int(os.environ.get("WORLD", "2")))]
        for p in ps: p.start()
        for p in ps: p.join(120)
        codes = [p.exitcode for p in ps]
        for p in ps:
            if p.exitcode is None: p.kill()
        if any(c != 0 for c in codes):
            fails += 1
        print(f"run {run+1} codes {codes} fails {fails}", flush=True)
    print("DONE", fails)
