"""A workload's backward timeline on 4 processes at once (2 cores), 3 times: each worker's own median
of five (before) and the iterations started together, the slowest worker from the common start (now)."""
import os, sys, json
import torch, torch.distributed as dist, torch.multiprocessing as mp

def work(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from sparcoll.plan.profiler import model_and_loss, Together
    from sparcoll.plan.profile import backward_timeline
    import importlib.util
    spec = importlib.util.spec_from_file_location("sparcoll.plan.old_profile", "/tmp/wt/pre/src/sparcoll/plan/profile.py")
    old = importlib.util.module_from_spec(spec); old.__package__ = "sparcoll.plan"; sys.modules[spec.name] = old; spec.loader.exec_module(old)
    model, loss_of = model_and_loss({"workload": sys.argv[1], "seed": 0, "options": {}, "batch_size": int(sys.argv[2])}, rank, world)
    rows = []
    for rep in range(3):
        for rule in ("own median of 5 (before)", "together, slowest (now)"):
            dist.barrier()
            t = old.backward_timeline(model, loss_of) if rule.startswith("own") else backward_timeline(model, loss_of, peers=Together())
            v = torch.tensor([t.forward, t.step.backward_end, t.step.optimizer], dtype=torch.float64)
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
            rows.append((rule, [round(x * 1e3, 2) for x in v.tolist()]))
    if rank == 0:
        json.dump(rows, open(out, "w"))
    dist.destroy_process_group()

if __name__ == "__main__":
    out = f"/tmp/tl/{sys.argv[1]}.json"
    mp.start_processes(work, args=(4, 29678, out), nprocs=4, start_method="spawn")
    for rule, v in json.load(open(out)):
        print(f"{sys.argv[1]:6s} {rule:26s} forward {v[0]:7.2f} ms  backward {v[1]:7.2f} ms  optimizer {v[2]:7.2f} ms")
