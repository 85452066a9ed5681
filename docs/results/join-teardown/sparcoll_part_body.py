import gc
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import test_torch_backend as t

def sparcoll_only(rank, world):
    from torch.distributed.algorithms.join import Join
    pg = t.sparcoll_group()
    ddp = DDP(t.Branching(), process_group=pg, find_unused_parameters=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with Join([ddp]):
        for step in range(2 if rank == 0 else 4):
            g = torch.Generator().manual_seed(10 * step + rank)
            x, y = torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)
            optimizer.zero_grad()
            ((ddp(x, step % 2 == 0) - y) ** 2).mean().backward()
            optimizer.step()
    dist.destroy_process_group(pg)
    del ddp, optimizer, pg
    gc.collect()
    return rank
