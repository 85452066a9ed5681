"""Train a sparcoll workload with DistributedDataParallel on the "sparcoll" backend, launched by torchrun.

This is what a user's own training script looks like with sparcoll: the two lines marked "sparcoll" are
the only change from a gloo script. Any torchrun launch works, on one host or many:

    torchrun --nproc-per-node 4 examples/torchrun_train.py --workload ncf --steps 50
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 \\
        --local-addr THIS_HOST_ADDRESS examples/torchrun_train.py --workload ncf

Dedicated aggregators come from the environment: SPARCOLL_AGGREGATORS=host:port,... and the shared
SPARCOLL_SECRET (docs/cluster.md). Rank 0 prints each step's loss and, with --out, writes the losses and
the final parameters (a torch file) for checking against a single-process reference. A restart by
torchrun (--max-restarts) starts training again from step 0, so the result does not depend on it;
--fail-at STEP makes the last rank exit abruptly at that step on the first attempt, to try it.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import sparcoll.torch  # noqa: F401  sparcoll: registers the "sparcoll" backend
from sparcoll.workloads import get_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="ncf")
    parser.add_argument("--tiny", action="store_true", help="the workload's small preset")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="samples per worker and step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--backend", default="sparcoll", help="sparcoll, or gloo for comparison")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds any collective may take")
    parser.add_argument("--out", help="rank 0 writes {'losses', 'params'} here (torch.save)")
    parser.add_argument("--fail-at", type=int, help="the last rank exits at this step on the first attempt")
    args = parser.parse_args()

    from datetime import timedelta
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))  # sparcoll
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    print(f"rank {rank}/{world} (host {os.environ.get('GROUP_RANK', '?')} of torchrun's rendezvous, local rank "
          f"{os.environ.get('LOCAL_RANK', '?')}), attempt {attempt}", flush=True)

    workload = get_workload(args.workload, tiny=args.tiny, seed=0)
    model = DistributedDataParallel(workload.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    losses = []
    batches = workload.batches(args.batch, rank, world, seed=0)
    for step in range(args.steps):
        if args.fail_at == step and attempt == 0 and rank == world - 1:
            print(f"rank {rank}: exiting abruptly at step {step} (--fail-at)", flush=True)
            os._exit(3)
        optimizer.zero_grad()
        loss = workload.loss(model, next(batches))
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if rank == 0:
            print(f"step {step} loss {losses[-1]:.6f}", flush=True)

    if args.backend == "sparcoll":  # proof that the gradients went through sparcoll, and what they cost
        traffic = sparcoll.torch.stats()
        print(f"rank {rank}: {traffic.collectives} sparcoll collectives (the gradients' and each step's loss "
              f"mean), {traffic.bytes_sent / 1e6:.2f} MB sent by the sparse path; {traffic.ring_collectives} of "
              f"them, {traffic.ring_bytes / 1e6:.2f} MB of tensors, through gloo's ring", flush=True)
    if rank == 0 and args.out:
        params = {name: p.detach().clone() for name, p in workload.model.named_parameters()}
        torch.save({"losses": losses, "params": params, "world": world, "attempt": attempt}, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # torch 2.13 sometimes aborts in its static destructors at interpreter exit ("terminate called without
    # an active exception", about 1 exit in 8, with plain gloo too); torchrun would count that as a failed
    # worker and make the other hosts' agents wait for it. Training is over and saved: leave directly.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
