"""Run a function on N local ranks (spawned processes sharing a TCPStore) and collect what each returns.

The parent hosts the store on port 0, so no port is ever guessed. Every child has a deadline, is killed
if it overruns, and reports its result or its traceback through a queue.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from datetime import timedelta

import torch.distributed as dist


def _child(target, rank, world, port, results, kwargs):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        try:
            results.put((rank, "ok", target(rank, world, **kwargs)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(target, world: int, timeout: float = 60.0, env: dict | None = None, dying: int = 0,
              **kwargs) -> list:
    """Run target(rank, world, **kwargs) on `world` processes; return the results in rank order.
    Raises AssertionError with every failing rank's traceback, or on timeout. `dying`: how many ranks
    are meant to die without a result (the others' results are returned)."""
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    results = ctx.Queue()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    procs = [ctx.Process(target=_child, args=(target, r, world, store.port, results, kwargs),
                         daemon=True) for r in range(world)]
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    got, errors = {}, []
    try:
        while len(got) + len(errors) < world - dying:
            try:
                rank, status, value = results.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"ranks {sorted(set(range(world)) - set(got))} did not "
                                     f"finish within {timeout} s") from None
            if status == "ok":
                got[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise AssertionError("\n".join(errors))
        return [got[r] for r in sorted(got)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        del store
