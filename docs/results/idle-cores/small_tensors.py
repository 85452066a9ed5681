"""4 workers on this machine's 2 cores: blocktopk's and onebit's compress and decompress of small
tensors timed as the profile's curves are (profiler.timed: process CPU, after a barrier) and on the
thread's own clock, 200 calls back to back."""
import os, sys, time, statistics
import torch, torch.distributed as dist
import torch.multiprocessing as mp

def work(rank, world, port, q):
    os.environ["OMP_NUM_THREADS"] = "1"; torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from sparcoll.plan.profiler import timed, decompress_into
    from sparcoll.compress.reducer import Reducer
    out = {}
    for spec in ("blocktopk:0.01", "onebit"):
        reducer = Reducer(spec)
        for n in (384, 4096, 65536):
            x = torch.randn(n)
            last = [None]
            t = timed(lambda _: last.__setitem__(0, reducer.compress(x, key=n)))
            into = torch.empty(n)
            d = timed(lambda _: decompress_into(reducer.compressor, last[0], world, into))
            th = []
            for _ in range(200):
                c = time.thread_time(); last[0] = reducer.compress(x, key=n); th.append(time.thread_time() - c)
            thd = []
            for _ in range(200):
                c = time.thread_time()
                decompress_into(reducer.compressor, last[0], world, into)
                thd.append(time.thread_time() - c)
            out[(spec, n)] = (t.cpu, t.seconds, statistics.median(th), d.cpu, statistics.median(thd))
    q.put((rank, out))
    dist.destroy_process_group()

if __name__ == "__main__":
    world = 4; q = mp.get_context("spawn").Queue()
    import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    ps = [mp.get_context("spawn").Process(target=work, args=(r, world, port, q)) for r in range(world)]
    [p.start() for p in ps]
    res = dict(q.get(timeout=600) for _ in ps)
    [p.join(60) for p in ps]
    print(f"{'spec':<16}{'n':>7} {'timed cpu':>10} {'timed s':>8} {'thread':>8} | "
          f"{'dec timed cpu':>13} {'dec thread':>10}  (us, rank 0)")
    for k, v in res[0].items():
        print(f"{k[0]:<16}{k[1]:>7} " + " ".join(f"{1e6*x:9.0f}" for x in v))
