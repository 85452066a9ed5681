"""Run a function on N local ranks (processes sharing a TCPStore) and collect what each returns.

Ranks are forked from the session's fork server, which has imported torch and sparcoll already
(tens of ms a process instead of an import of 1-2 s each; sparcoll/bench/forked.py; test_faults.py
and the launcher of the jobs that tests run in this process fork from it too). A child
runs in the environment its parent had when it was created, as a spawned process would (the server's
own environment, fixed when it started, is seen only by code that runs at import). The parent hosts the
store on port 0, so no port is ever guessed. Every child has a deadline, is killed if it overruns, and
reports its result or its traceback through a queue; a rank that overruns is asked for every
thread's stack (faulthandler, on SIGUSR1) before it is killed, and the stacks go into the failure.
"""
from __future__ import annotations

import faulthandler
import os
import queue
import signal
import tempfile
import time
import traceback
from datetime import timedelta

import torch.distributed as dist

from sparcoll.bench.forked import fork_context

def fork_process(target, *args, env: dict | None = None):
    """A daemon process (not started) of the fork server that runs target(*args) in this process's
    current environment updated with `env`."""
    environ = {**os.environ, **(env or {})}
    return fork_context().Process(target=_in_environment, args=(environ, target, *args), daemon=True)


def _in_environment(environ: dict, target, *args):
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


def _child(target, rank, world, port, results, kwargs, stacks_path):
    os.environ["OMP_NUM_THREADS"] = "1"
    stacks = open(stacks_path, "w")     # open while the rank runs: faulthandler writes to its descriptor
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
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
    store = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    results = fork_context().Queue()
    stacks_dir = tempfile.TemporaryDirectory(prefix="sparcoll-ranks-")
    stacks = [os.path.join(stacks_dir.name, f"rank{r}") for r in range(world)]
    procs = [fork_process(_child, target, r, world, store.port, results, kwargs, stacks[r], env=env)
             for r in range(world)]
    got, errors = {}, {}
    try:
        for p in procs:
            p.start()
        while len(got) + len(errors) < world - dying:
            try:
                rank, status, value = results.get(timeout=timeout)
            except queue.Empty:
                missing = sorted(set(range(world)) - set(got) - set(errors))
                raise AssertionError(f"ranks {missing} did not finish within {timeout} s\n"
                                     + "\n".join(_whereabouts(procs[r], stacks[r], r) for r in missing)
                                     + "".join(f"\nrank {r}:\n{e}" for r, e in errors.items())) from None
            if status == "ok":
                got[rank] = value
            else:
                errors[rank] = value
        if errors:
            raise AssertionError("\n".join(f"rank {r}:\n{e}" for r, e in sorted(errors.items())))
        return [got[r] for r in sorted(got)]
    finally:
        # Every result is in (or the run failed): the processes get one grace period together, not
        # each its own; where a rank died, the others' destroy_process_group may wait on gloo's pair
        # with it, and their results are in, so they get less.
        ends = time.monotonic() + (3 if dying else 10)
        for p in (p for p in procs if p.pid is not None):
            p.join(timeout=max(0.0, ends - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        del store
        stacks_dir.cleanup()


def _whereabouts(proc, stacks_path: str, rank: int) -> str:
    """What an overdue rank is doing: every thread's stack if it is alive (asked for with SIGUSR1,
    waited for up to 3 s), its exit code if not."""
    if proc.exitcode is not None:
        return f"rank {rank} exited with code {proc.exitcode} without a result"
    try:
        os.kill(proc.pid, signal.SIGUSR1)
    except ProcessLookupError:
        return f"rank {rank} exited without a result"
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and not _written(stacks_path):
        time.sleep(0.05)
    time.sleep(0.2)                     # the last threads' lines
    stacks = open(stacks_path).read() if _written(stacks_path) else ""
    return f"rank {rank} is alive; its threads:\n{stacks or '(no answer to SIGUSR1)'}"


def _written(path: str) -> bool:
    """Whether the file exists (a rank creates it as it starts) and holds something."""
    return os.path.exists(path) and os.path.getsize(path) > 0
