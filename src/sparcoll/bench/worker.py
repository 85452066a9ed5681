"""One benchmark worker process: times every (density, algorithm) series on the gloo group, the
algorithms' timed repetitions interleaved (run_point).

Started by `launch.py`, one per host, as `python -m sparcoll.bench.worker CONFIG.json` with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment. Rank 0 reports to the launcher with event
lines on stdout (events.py).

Timing, the same for every algorithm: the payload is prepared (a fresh copy of the input) outside the
timed region; a gloo barrier is the common start; each rank times from the barrier's return to its own
completion; an all_reduce(MAX) over ranks then gives the repetition's time, the time of the last rank to
finish, and only after it does any rank check its result (a rank that finished first would otherwise
take CPU from those still running: here all hosts share two cores). Ranks leave a barrier a few ms
apart on an oversubscribed machine, so this slightly overestimates, never underestimates, the collective.

Traffic, per rank and repetition: on an emulated network the byte counters of the namespace's interface
(`/proc/self/net/dev` reads the reader's namespace), sampled before the barrier and after the
all_reduce(MAX), so they include the headers, ACKs and the two small synchronization collectives; on
loopback, the algorithm's own counters when it has some (sparcoll), otherwise nothing (the report uses the
algorithm's known traffic).

CPU, per repetition: the CPU seconds of every worker process (all its threads: gloo's, sparcoll's
receivers and its colocated aggregator) from the barrier's return to the all_reduce(MAX), summed over
ranks. Where hosts share a machine's cores, this over the cores is as fast as the collective could
run however its work were spread (dedicated aggregators run in processes of their own: not counted).
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

import sparcoll
from sparcoll.bench.algorithms import REGISTRY, Algorithm, Context, Inputs
from sparcoll.bench.events import emit, reporting
from sparcoll.bench.netns import interface_counters
from sparcoll.bench.patterns import InputSpec, check


class WrongResult(RuntimeError):
    """An algorithm returned a sum that is not the sum: the run fails, it is not a data point."""


class Series:
    """One algorithm's repetitions on one input: its times and per-rank traffic so far."""

    def __init__(self, ctx: Context, algo: Algorithm, inputs: Inputs, spec: InputSpec,
                 expected: torch.Tensor, tolerance: torch.Tensor, cfg: dict):
        self.ctx, self.algo, self.inputs, self.spec = ctx, algo, inputs, spec
        self.expected, self.tolerance = expected, tolerance
        if cfg["interface"]:
            self.counters, self.source = (lambda: interface_counters(cfg["interface"])), "interface"
        elif algo.counters:
            self.counters, self.source = (lambda: algo.counters(ctx)), algo.name
        else:
            self.counters, self.source = (lambda: (0, 0)), None
        self.times: list[float] = []
        self.traffic: list[tuple[int, int]] = []
        self.cpu: list[float] = []      # this process's CPU seconds in each timed repetition
        self.reps = 0

    def repetition(self, timed: bool) -> None:
        """One repetition: a fresh payload, a barrier, the timed allreduce, the check."""
        ctx, algo = self.ctx, self.algo
        payload = algo.prepare(ctx, self.inputs)
        before = self.counters()
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        algo.run(ctx, payload)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        # Every rank is done before any checks: a rank that finished first must not take CPU
        # from those still running (on one machine the hosts share the cores).
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        cpu = time.process_time() - cpu_start   # to the last rank's end: a colocated aggregator
                                                # may still be serving the others after its worker
        ok, error = check(algo.result(ctx, payload), self.expected, self.tolerance)
        summary = torch.tensor([float(not ok), error], dtype=torch.float64)
        dist.all_reduce(summary, op=dist.ReduceOp.MAX)
        after = self.counters()
        if summary[0] > 0:
            if not ok:
                print(f"rank {ctx.rank}: wrong result, largest error {error:.3g}", file=sys.stderr)
            raise WrongResult(f"{algo.label} at density {self.spec.density} returned a wrong sum in "
                              f"repetition {self.reps} (largest error {float(summary[1]):.3g}, "
                              f"beyond the float32 summation tolerance)")
        if timed:
            self.times.append(float(elapsed))
            self.traffic.append((after[0] - before[0], after[1] - before[1]))
            self.cpu.append(cpu)
        if ctx.rank == 0:
            emit({"event": "rep", "algo": algo.name, "input": algo.input,
                  "density": self.spec.density, "rep": self.reps, "warmup": not timed})
        self.reps += 1

    def result(self) -> dict:
        """Rank 0's result event (every rank must call it: the traffic is averaged over ranks)."""
        algo = self.algo
        per_rank = torch.tensor(self.traffic, dtype=torch.float64)
        dist.all_reduce(per_rank)
        mean = (per_rank / self.ctx.world).tolist()
        cpu = torch.tensor(self.cpu, dtype=torch.float64)
        dist.all_reduce(cpu)
        credits = self.ctx.comms[algo.communicator].config.credits if algo.needs_communicator else None
        return {"event": "result", "algo": algo.name, "input": algo.input,
                "density": self.spec.density, "times_s": self.times, "cpu_s": cpu.tolist(),
                "bytes_source": self.source,
                "credits": credits, "bytes_sent": [s for s, _ in mean] if self.source else None,
                "bytes_received": [r for _, r in mean] if self.source else None}


def run_point(series: list[Series], cfg: dict, seed: int) -> None:
    """Every algorithm's warm-up repetitions, one algorithm after the other (a sparcoll kind's
    first collectives are its trials), then the timed ones interleaved: each round of
    repetitions runs every algorithm once, in an order shuffled by `seed` (the same on every
    rank). A busy moment of the machine, or its drift over a series, then falls on every
    algorithm alike instead of on the one whose series it was (2 workers on loopback: one
    repetition of gloo's ring took 31 to 49 ms in one series of 15). The variants of one
    communicator stay together, in their order: it learns the order of its calls
    (sparcoll/ring.py, expected calls), as it would from a training step's."""
    for s in series:
        for _ in range(s.algo.warmup(cfg["warmup"])):
            s.repetition(timed=False)
    groups: dict = {}
    for s in series:
        groups.setdefault(s.algo.communicator or s, []).append(s)
    order = random.Random(seed)
    for _ in range(cfg["repeat"]):
        for group in order.sample(list(groups.values()), len(groups)):
            for s in group:
                s.repetition(timed=True)


def bench(cfg: dict, rank: int, world: int) -> None:
    algos = [REGISTRY[(name, kind)] for name, kind in cfg["algos"]]
    ctx = Context(rank, world, cfg["numel"], cfg["row_width"])
    for mode in dict.fromkeys(a.communicator for a in algos if a.needs_communicator):
        ctx.comms[mode] = sparcoll.init(block_size=cfg["block_size"], aggregators=cfg["aggregators"],
                                        timeout=cfg["timeout"], algorithm=mode)
    try:
        for density in cfg["densities"]:
            spec = InputSpec(cfg["numel"], cfg["row_width"], world, density, cfg["overlap"], cfg["seed"])
            indices, values = spec.blocks(rank)
            inputs = Inputs(spec.to_dense(indices, values), indices, values)
            expected, tolerance = spec.expected()
            series = [Series(ctx, algo, inputs, spec, expected, tolerance, cfg) for algo in algos]
            run_point(series, cfg, cfg["seed"])
            for s in series:
                result = s.result()
                if rank == 0:
                    emit(result)
    finally:
        for comm in ctx.comms.values():
            comm.close()


def run_worker(argv: list[str] | None, body, backend=lambda cfg: "gloo") -> int:
    """A job's worker process as the launcher starts it: read the configuration file argv[0], join the
    job's torch.distributed group (the launcher's environment, backend(cfg)), run body(cfg, rank,
    world) with rank 0 reporting how it ended, and leave the group on every way out."""
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        cfg = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port_file = os.environ.get("SPARCOLL_MASTER_PORT_FILE")
    meeting = {"store": _hosted_store(rank, world, port_file, cfg["timeout"])} if port_file else \
        {"init_method": f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"}
    dist.init_process_group(backend(cfg), rank=rank, world_size=world, timeout=timedelta(seconds=cfg["timeout"]),
                            **meeting)
    try:
        with reporting(rank):
            body(cfg, rank, world)
    finally:
        dist.destroy_process_group()
    return 0


def _hosted_store(rank: int, world: int, port_file: str, timeout: float) -> dist.TCPStore:
    """The job's Store on loopback: rank 0 hosts it on a port the kernel picks and writes the port to
    `port_file`, where the others read it. A port the launcher found free could be taken by another
    job before rank 0 bound it (EADDRINUSE, once when two test files ran at once)."""
    host, wait = os.environ["MASTER_ADDR"], timedelta(seconds=timeout)
    if rank == 0:
        store = dist.TCPStore(host, 0, world, is_master=True, wait_for_workers=False, timeout=wait)
        with open(port_file + ".tmp", "w") as f:
            f.write(str(store.port))
        os.rename(port_file + ".tmp", port_file)    # whole when it appears
        return store
    deadline = time.monotonic() + timeout
    while not os.path.exists(port_file):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 did not host the job's store within {timeout:g} s")
        time.sleep(0.01)
    with open(port_file) as f:
        port = int(f.read())
    return dist.TCPStore(host, port, world, is_master=False, timeout=wait)


def exit_process(status: int) -> NoReturn:
    """Leave a worker process without the interpreter's teardown: torch 2.13 sometimes aborts in its
    static destructors ("terminate called without an active exception", about one exit in eight, with
    plain gloo too), which the launcher would take for a crashed worker. The worker has reported and
    left its group by then; only flushing remains."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv: list[str] | None = None) -> int:
    return run_worker(argv, bench)


if __name__ == "__main__":
    exit_process(main())
