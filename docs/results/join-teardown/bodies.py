"""The rank bodies the loop runs (importable by the fork server's children, unlike loop.py's)."""
import gc

import torch.distributed as dist

import test_torch_backend as t


def whole(rank, world):
    """The test's rank body as it is (its models kept until the rank exits)."""
    t.join_with_uneven_inputs(rank, world)
    return rank


def sparcoll_part(rank, world):
    """Only the "sparcoll" group's training under Join, its model freed at once."""
    pg = t.sparcoll_group()
    ddp = t.train_under_join(rank, pg)
    dist.destroy_process_group(pg)
    del ddp, pg
    gc.collect()
    return rank
