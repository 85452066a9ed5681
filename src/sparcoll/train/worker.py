"""One worker process of `sparcoll train`: DDP training of a workload with one communication mode, or with
several interleaved (--interleave: each mode its own model, a step of each in turn; train).

Started by command.py as `python -m sparcoll.train.worker CONFIG.json` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set. Rank 0 reports every step to the launcher as an event line (the bench
harness's format, so its launcher follows the job).

Modes (the same model, seeds and per-step global batches, so loss curves compare):
  ddp       DDP on gloo
  sparcoll  DDP on the "sparcoll" backend (sparcoll.torch)
  hook      DDP on gloo with sparcoll.torch.allreduce_hook, or with sparcoll.torch.compression_hook
            when the config names a compressor spec ("compress")
  agsparse  DDP on gloo with sparse embedding gradients (gloo's AllGather-based sparse all_reduce)
  poseidon  sparcoll.torch.DataParallel (wait-free backpropagation, a strategy per tensor: the config's
            "strategy", default Poseidon's hybrid choice); each step also reports the bytes the
            wrapper's cost model predicts this worker sends, and how long its synchronizations took
            in all and before backward had finished computing (the part hidden behind backward); the
            last step's trace (each tensor's ready, start and end) is reported once
  poseidon-blocking  the same without wait-free backpropagation: every synchronization waits for the
            end of backward (Poseidon's ablation)
  planned   sparcoll.torch.DataParallel executing a plan of `sparcoll plan` (the config's "strategy");
            with the config's "model_spec" instead of a workload, on a user's own model (the
            planner's trial of `sparcoll plan --model`; workloads.user)

Plain DDP on sparse gradients (plain_ddp_on_sparse_gradients) crashes in native code now and then
(torch 2.13's gloo; docs/reliability.md): the launcher (command.launch) runs such a job again then.

DDP runs with gradient_as_bucket_view=True: gradients live in DDP's buckets, one copy of the
gradients fewer per step and per process (what a memory-minded user sets; vgg's 8 workers fit in
memory only so).

Every worker keeps freed memory for reuse (sparcoll.keep_freed_memory), whatever its mode: glibc
unmaps a freed block above 32 MiB, so a large gradient allocated anew by every backward (deeplight's
68 MB embedding gradient) would fault every page in again each step, on the cores the communication
needs. DDP's steps gain as much as the others'.

A step is timed from the forward to the end of the optimizer step. Its communication time is the part
that did not overlap computation: from the moment the last local gradient was computed (DDP then hands
over the last bucket) to the end of backward, which waits for every bucket. The rest is computation.
Every step notes when each local gradient was computed (a timestamp per parameter). Every PROBE_EVERY-th
step from the first (a "probed" step) also marks each local gradient's non-zero elements inside
backward: a pass over every gradient (deeplight's 16.9M-row table as a dense mask when its gradient is
sparse) on the training thread, which delays every later gradient and so the communication started
with it. Probed steps report the densities and are left out of the step times (command.timed_steps);
the others report no density. On an emulated network
each step also reports the bytes this host's interface sent (every mode alike; none on loopback). After
the last step, a workload with a held-out split (gpt) reports its loss there. Per step, rank 0 reports
the mean loss over ranks (the full global batch's loss), the ranks' mean times (slowest_step_s: the
slowest rank's step), and on probed steps
the block density of the local gradients (mean over ranks) and of the reduced gradient: the fraction of
`block_size`-element blocks of all gradients, flattened in parameter order, that hold a non-zero
element; the most page faults a rank took in the step (minor_faults: a step that faulted in fresh
memory, as a heap that grew does, is slow for that, not for its communication); and the most CPU
seconds a rank's process (every thread of it) spent in the step (cpu_s: what the planner's CPU bound
predicts, timeline.Step.cpu_bound) and the ranks' mean of it (cpu_mean_s: with the step's time and the
cores, how long the cores stood idle while every rank waited), and of it the training thread's (the
ranks' mean, training_thread_cpu_s: the forward, backward, optimizer and whatever a strategy runs on
that thread, against what the other threads spend, each priced apart by the planner); before each
step, outside its time, every rank times a fixed piece of CPU work (bench.speed): the ranks' mean
(reference_cpu_s) says how fast the machine ran then, so that steps measured minutes apart can be
compared.

Why the mean and not the slowest rank's step: that piece of work, the gather of each step's times and
rank 0's report start the ranks' next steps apart, and the rank that starts first waits in its first
collective for the others, its step the longer for it (ncf's plan on 4 workers at 1 Gbit/s: the ranks
started 12.4 ms apart at the median, the slowest rank's step 43.9 ms, the mean 38.2; in training
without these reports no rank waits so). Every rank's step ends with the same last collective, so the
mean step is the time between steps less the ranks' mean time in these reports
(docs/results/step-skew).
"""
from __future__ import annotations

import functools
import math
import random
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sparcoll
import sparcoll.torch  # registers the "sparcoll" backend
from sparcoll.bench.events import emit
from sparcoll.bench.memory import minor_faults
from sparcoll.bench.netns import interface_counters
from sparcoll.bench.speed import reference_cpu_s
from sparcoll.bench.worker import exit_process, run_worker
from sparcoll.blocks import BlockTensor
from sparcoll.workloads import get_workload
from sparcoll.workloads.user import UserModel

MODES = ("sparcoll", "ddp", "hook", "agsparse", "poseidon", "poseidon-blocking", "planned")
DATA_PARALLEL = ("poseidon", "poseidon-blocking", "planned")     # the modes of sparcoll.torch.DataParallel
WITH_COMMUNICATOR = ("hook", "poseidon", "planned")     # the modes given a sparcoll Communicator


def nonzero_elements(grad: torch.Tensor) -> torch.Tensor:
    """Flat bool mask of the non-zero elements of a dense or sparse COO gradient (-0.0 is zero)."""
    if grad.layout == torch.sparse_coo:
        grad = grad.coalesce()
        marks = torch.zeros(grad.shape, dtype=torch.bool)
        marks[tuple(grad.indices())] = grad.values() != 0
        return marks.view(-1)
    return (grad != 0).reshape(-1)


def block_density(marks: list[torch.Tensor], block_size: int) -> float:
    """Fraction of the blocks of the concatenated masks that hold a True (sparcoll's own scan)."""
    blocks = BlockTensor(torch.cat(marks), block_size)
    return blocks.nonzero().size / blocks.nblocks


# Probing a step's densities costs ncf with sparse embeddings (4 workers on 2 cores) several ms of a
# 40 ms step inside backward; one step in ten still follows how the densities evolve.
PROBE_EVERY = 10


class GradientProbe:
    """Sees each trained parameter's local gradient as autograd computes it, before DDP reduces it: notes
    the time of the last one and, when `marking`, records its non-zero mask (and how long that took).
    A frozen parameter (requires_grad False) gets no gradient to see or to send: left out, densities too."""

    def __init__(self, params: list[nn.Parameter], block_size: int):
        self.params, self.block_size = [p for p in params if p.requires_grad], block_size
        for index, param in enumerate(self.params):
            param.register_hook(functools.partial(self._seen, index))
        self.reset(marking=False)

    def reset(self, marking: bool) -> None:
        self.marking = marking
        self.marks: list[torch.Tensor | None] = [None] * len(self.params)
        self.last_gradient = None
        self.overhead = 0.0

    def _seen(self, index: int, grad: torch.Tensor) -> None:
        start = time.perf_counter()
        if self.marking:
            self.marks[index] = nonzero_elements(grad)
        self.last_gradient = time.perf_counter()
        self.overhead += self.last_gradient - start

    def _counted(self) -> list[int]:
        """The parameters the densities count: those whose gradient autograd computed here, and those
        that got none (unused: zeros); not one whose average arrived without a local gradient (an SFB
        weight: autograd never computes it, and it read as all zeros, 0.4% for a head of 99%)."""
        return [i for i, (p, m) in enumerate(zip(self.params, self.marks)) if m is not None or p.grad is None]

    def local_density(self) -> float:
        counted = self._counted()
        return block_density([torch.zeros(self.params[i].numel(), dtype=torch.bool) if self.marks[i] is None
                              else self.marks[i] for i in counted], self.block_size) if counted else math.nan

    def reduced_density(self) -> float:
        counted = [self.params[i] for i in self._counted()]
        return block_density([torch.zeros(p.numel(), dtype=torch.bool) if p.grad is None
                              else nonzero_elements(p.grad) for p in counted], self.block_size) if counted else math.nan


def workload_arguments(cfg: dict) -> dict:
    return {"sparse_embeddings": cfg["comm"] == "agsparse", **cfg["options"]}   # or as the user says


def plain_ddp_on_sparse_gradients(cfg: dict) -> bool:
    """Whether the job is DDP on gloo reducing sparse (COO) gradients itself (modes ddp and agsparse; the
    hook sends them through sparcoll). A workload's model has them by its options, a user's model
    (sparcoll plan --model's trial) by its modules, which this builds to see."""
    if cfg["comm"] not in ("ddp", "agsparse"):
        return False
    if cfg.get("model_spec"):
        return bool(sparcoll.torch.sparse.sparse_weights(UserModel(cfg["model_spec"]).model))
    return bool(workload_arguments(cfg)["sparse_embeddings"])


class Trainer:
    """One mode's model, optimizer and batches in this worker: a step at a time, each reported by rank 0
    as an event (with `tag`'s fields: the mode's index when several modes interleave)."""

    def __init__(self, cfg: dict, rank: int, world: int, comm: sparcoll.Communicator | None, tag: dict):
        self.cfg, self.rank, self.world, self.tag = cfg, rank, world, tag
        mode = cfg["comm"]
        self.workload = workload = (
            UserModel(cfg["model_spec"]) if cfg.get("model_spec")      # sparcoll plan --model's trial
            else get_workload(cfg["workload"], data=cfg["data"], seed=cfg["seed"], **workload_arguments(cfg)))
        self.poseidon = mode in DATA_PARALLEL
        if self.poseidon:
            self.model = sparcoll.torch.DataParallel(workload.model, comm=comm,
                                                     strategy=cfg.get("strategy") or "auto",
                                                     wait_free=mode != "poseidon-blocking")
        else:
            self.model = DistributedDataParallel(workload.model, gradient_as_bucket_view=True,
                                                 find_unused_parameters=cfg.get("find_unused_parameters", False))
        self.compression = None
        if mode == "hook" and cfg.get("compress"):
            self.compression = sparcoll.torch.CompressionState(comm, cfg["compress"])
            self.model.register_comm_hook(self.compression, sparcoll.torch.compression_hook)
        elif mode == "hook":
            self.model.register_comm_hook(sparcoll.torch.HookState(comm), sparcoll.torch.allreduce_hook)
        params = list(workload.model.parameters())
        self.optimizer = torch.optim.SGD(params, lr=cfg["lr"])
        self.probe = GradientProbe(params, cfg["block_size"])
        self.batches = workload.batches(cfg["batch_size"], rank, world, cfg["seed"])
        self.backward_start = 0.0

    def step(self, step: int) -> None:
        model, probe, interface = self.model, self.probe, self.cfg.get("interface")
        batch = next(self.batches)
        self.optimizer.zero_grad()
        probed = step % PROBE_EVERY == 0
        probe.reset(marking=probed)
        sent = interface_counters(interface)[0] if interface else 0
        reference = reference_cpu_s()
        faults = minor_faults()
        cpu, thread_cpu, start = time.process_time(), time.thread_time(), time.perf_counter()
        loss = self.workload.loss(model, batch)
        self.backward_start = time.perf_counter()
        loss.backward()
        backward_end = time.perf_counter()
        self.optimizer.step()
        step_s = time.perf_counter() - start - probe.overhead
        cpu, thread_cpu = time.process_time() - cpu, time.thread_time() - thread_cpu
        faults = minor_faults() - faults
        sent = interface_counters(interface)[0] - sent if interface else float("nan")
        comm_s = max(0.0, backward_end - probe.last_gradient) if probe.last_gradient else 0.0
        # Every rank measures (the same reduced density too) before the gather, which then lines the
        # ranks up again: no rank's bookkeeping shows up as communication time in the next step.
        predicted, total, hidden = synchronization(model) if self.poseidon else (float("nan"),) * 3
        densities = (probe.local_density(), probe.reduced_density()) if probed else (float("nan"),) * 2
        row = torch.tensor([loss.item(), step_s, comm_s, *densities, sent, predicted, total, hidden, faults, cpu,
                            reference, thread_cpu], dtype=torch.float64)
        rows = [torch.empty_like(row) for _ in range(self.world)]
        dist.all_gather(rows, row)
        if self.rank == 0:
            table = torch.stack(rows)
            slowest = table[table[:, 1].argmax()]
            mean = table.mean(dim=0)
            emit({"event": "step", **self.tag, "step": step, "probed": probed,
                  "loss": mean[0].item(), "step_s": mean[1].item(), "comm_s": mean[2].item(),
                  "compute_s": (mean[1] - mean[2]).item(), "slowest_step_s": slowest[1].item(),
                  "density_local": mean[3].item() if probed else None,
                  "density_union": row[4].item() if probed else None,
                  "bytes_sent": None if not interface else mean[5].item(),
                  "page_faults": int(table[:, 9].max().item()), "cpu_s": table[:, 10].max().item(),
                  "cpu_mean_s": mean[10].item(), "reference_cpu_s": mean[11].item(),
                  "training_thread_cpu_s": mean[12].item(),
                  **({"predicted_bytes": mean[6].item(), "comm_total_s": slowest[7].item(),
                      "comm_hidden_s": slowest[8].item()} if self.poseidon else {})})

    def finish(self) -> None:
        """The last step's trace and the held-out loss (rank 0), then DataParallel's or the compression
        hook's thread stopped."""
        if self.poseidon and self.rank == 0:
            emit({**trace(self.model, self.backward_start), **self.tag})
        if self.rank == 0 and hasattr(self.workload, "eval_loss"):      # parameters are identical on every rank
            emit({"event": "eval", **self.tag, "loss": self.workload.eval_loss(self.workload.model)})
        if self.poseidon:
            self.model.close()
        if self.compression is not None:
            self.compression.close()


def interleaved_order(modes: int, seed: int, step: int) -> list[int]:
    """The order the interleaved modes take their `step`: shuffled per step, so no mode always follows
    the same one, and the same on every rank (a function of the seed and the step alone)."""
    return random.Random(seed * 1_000_003 + step).sample(range(modes), modes)


def train(cfg: dict, rank: int, world: int) -> None:
    """The config's mode for its steps; or, with "modes" (each a dict of the config's fields that
    differ, "comm" among them), every one of them in this job, each with its own model, optimizer,
    batches and Communicator, a step of each in turn (interleaved_order): the machine's speed drifts
    over minutes, and modes run one after the other would each get a different part of that drift.
    (A Communicator each: its chooser knows a kind of collective by its size alone, and would take
    one mode's results for another's.)"""
    modes = cfg.get("modes") or [{}]
    comms: list[sparcoll.Communicator] = []
    try:
        trainers = []
        for index, mode in enumerate(modes):
            mode_cfg = {**cfg, **mode}
            comm = sparcoll.init(timeout=cfg["timeout"]) if mode_cfg["comm"] in WITH_COMMUNICATOR else None
            comms += [comm] if comm is not None else []
            trainers.append(Trainer(mode_cfg, rank, world, comm, {"mode": index} if "modes" in cfg else {}))
        for step in range(cfg["steps"]):
            for index in interleaved_order(len(trainers), cfg["seed"], step):
                trainers[index].step(step)
        for trainer in trainers:
            trainer.finish()
    finally:
        for comm in comms:
            comm.close()


def trace(model: sparcoll.torch.DataParallel, backward_start: float) -> dict:
    """Rank 0's last step as DataParallel traced it, in seconds from the start of backward: when each
    tensor was ready and its synchronization started and ended, and when backward finished computing
    (what `sparcoll plan` predicts, to compare)."""
    return {"event": "trace", "backward_end": model.backward_end - backward_start,
            "tensors": [[e.name, e.strategy, e.ready - backward_start, e.start - backward_start,
                         e.end - backward_start] for e in model.trace]}


def synchronization(model: sparcoll.torch.DataParallel) -> tuple[float, float, float]:
    """DataParallel's last step: the bytes its cost model predicts this worker sent (nan where a
    compressor's are not predicted), the seconds its synchronization thread was busy, and the part of
    them before backward finished computing. Tensors that share a collective (a bucket, a unit) share
    its span: it counts once (summed per tensor, deeplight's unit of ten tensors made 243 ms of
    synchronization in a 78 ms step)."""
    predicted = sum(e.get("predicted_bytes", float("nan")) for e in model.strategy().values())
    spans = sorted({(e.start, e.end) for e in model.trace})
    total = hidden = 0.0
    reached = float("-inf")
    for start, end in spans:
        start = max(start, reached)
        if end > start:
            total += end - start
            hidden += max(0.0, min(end, model.backward_end) - start)
            reached = end
    return predicted, total, hidden


def main(argv: list[str] | None = None) -> int:
    sparcoll.keep_freed_memory()    # every mode alike: a large gradient reuses the last one's pages
                                    # (nearly always: the steps report their page faults)
    return run_worker(argv, train,
                      backend=lambda cfg: "sparcoll" if cfg["comm"] == "sparcoll" else "gloo")


if __name__ == "__main__":
    exit_process(main())
