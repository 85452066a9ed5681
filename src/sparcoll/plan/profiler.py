"""`sparcoll plan --profile`'s worker: one process per worker of a job on the user's network (or the
emulated one), measuring what the planner's cost models are fitted to (costs.py):

  model        the backward timeline (profile.backward_timeline) with every worker computing at once,
               each iteration started together and timed when the slowest worker got there
               (Together) (without communication: under DataParallel's ring, communication's CPU made
               vgg's backward 3x longer than under SFB, which sends 2% of the ring's bytes, so one
               strategy's interference cannot stand for all); each
               gradient's block density on one worker and over the union of workers; the rows each
               linear layer sees per step (SFB's K); the cores each worker has (offloading needs a
               spare one). The timeline and a training step's CPU (below) are measured in
               TIMELINE_WINDOWS windows, at the profile's start, after the compressors and at its end,
               and averaged (averaged_windows): the machine's speed drifts over tens of seconds
  SFB          per linear layer, what SFB changes, where it runs: the local weight gradient it spares
               backward, from the same backward timeline measured again with every such layer's weight
               gradient skipped (spared_in_backward: timed apart, vgg's product took more than the
               layer's whole backward), and its rebuild from every worker's factors (K x workers rows,
               written into a preallocated gradient as the executor does) alone and on a second thread
               while the training thread trains, as the synchronization thread rebuilds during
               backward, which slows as much as the rebuild does (rebuild_beside_training)
  lookups      per embedding declared dense, the backward work that looking its rows up sparse spares
               (as DataParallel does under the sparse AllReduce): the backward timeline and a backward's
               CPU measured again so (spared_by_lookups)
  compressors  compress and decompress time of each compressor by tensor size, and on each of the
               model's gradients of at least OWN_GRADIENT elements (the time depends on the data), every
               worker at once; on every dense gradient of the model, a compressor that compresses
               apart from its collective is timed again where a plan runs it, inside backward on the
               training thread while every worker trains and a second thread decompresses
               (compress_in_backward: those times are the ones priced, the ones apart are kept as
               `compress_alone` and `decompress_alone`)
  COO          each sparse COO gradient of the model (nn.Embedding(sparse=True)) under each option it
               can take, timed whole on the gradient itself, alone and under load as below: its cost
               is its rows, which no curve by dense size predicts
  collectives  the real collectives' time by size (ring allreduce, parameter server, allgather, and
               sparcoll's sparse AllReduce at several densities, with the communicator's default
               algorithm as the executor runs it: a dense input may take its ring): the slowest worker's median
  contention   each of those collectives again on a second thread while the training thread runs the
               model's forward and backward back to back, as under DataParallel: the collective's
               median time then (`loaded`) and how many times longer a step took meanwhile
               (`slowdown`; 4 workers on 2 cores at 1 Gbit/s: a 4 KB ring allreduce took 18.4 ms
               beside gpt's backward, 5.0 alone, and the steps up to 1.85x as long). The collectives
               run for at least a step, and the slowdown is of the steps' work while they ran
  CPU          with each time alone above (a collective, a compressor, a COO gradient's option, SFB's
               rebuild), the CPU seconds a worker's process spent in it (the workers' mean), and a
               training step's (step_cpu): 4 workers on 2 cores run their fastest strategies as fast
               as their CPU allows (timeline.Step.cpu_bound); a compressor timed inside backward, the
               CPU of the thread that compressed or decompressed there (the ones apart kept as
               `compress_cpu_alone` and `decompress_cpu_alone`)
  held         each ring allreduce of at most HELD_BYTES started on gloo's threads right before a
               sparse AllReduce, as DataParallel runs an uncompressed tensor beside the channel: how
               much later the sparse AllReduce finished than alone (held_beside)
  speed        before each measurement timed alone (`timed`: the collectives, compressors and steps
               above, not those under load or inside backward), bench.speed's reference work: the
               machine's speed the profile's times hold for (its median, `reference_cpu_s`), to read a
               step measured at another time beside (sparcoll train reports the same per step)

Rank 0 reports each measurement as an event (sparcoll.bench.events); `fit` turns them into the fits
costs.Costing takes. A model is a workload (`workload`, `options`, `batch_size`) or the user's
(`model_spec`: "module:function" returning (nn.Module, example input of one worker)).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import itertools
import math
import os
import socket
import statistics
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import sparcoll
from sparcoll.allocator import release_freed_memory
from sparcoll.bench.events import emit
from sparcoll.bench.speed import reference_cpu_s
from sparcoll.bench.worker import exit_process, run_worker
from sparcoll.blocks import BlockTensor
from sparcoll.compress import Reducer
from sparcoll.compress.channel import Channel, block_rows
from sparcoll.torch import sparse
from sparcoll.torch.parallel import takes_average_in_place
from sparcoll.torch.ps import ps_allreduce
from sparcoll.torch.sfb import eligible_layers
from sparcoll.workloads import get_workload
from sparcoll.workloads.user import UserModel

from .costs import BLOCKS, COO_KINDS, ITEMSIZE, MONOTONE, Curve, Grid, sparse_volume
from .fusion import coo_units
from .options import ALLGATHER, COMPRESSORS, PS, RING, SPARSE, coo_labels
from .profile import BackwardProfile, backward_timeline, facts, runs_that_fit

COLLECTIVE_BYTES = (1 << 12, 1 << 16, 1 << 20, 1 << 23, 1 << 25)
ALLGATHER_BYTES = (1 << 10, 1 << 14, 1 << 18, 1 << 21, 1 << 23)
SPARSE_NUMELS = (1 << 14, 1 << 18, 1 << 22, 1 << 24)
# Between 10% and 100% the executor's algorithm changes (a dense input takes the ring): a line from one
# to the other priced ncf's 856K-element embedding (30% per worker, 75% union) at 24 ms, measured 8.5-16.
SPARSE_DENSITIES = (0.01, 0.1, 0.3, 0.6, 1.0)
BLOCK_SHARES = (0.01, 0.1)  # the shares of blocks kept per worker the BLOCKS curve is measured at (blocktopk
                            # keeps 1% by default): a curve by bytes, which these spread over each size
HELD_BYTES = 1 << 20        # rings up to this size are timed beside a sparse AllReduce (held_beside) ...
HELD_DENSITY = 0.1          # ... of this density (45 ms on ncf: longer than them) ...
HELD_NUMEL = 1 << 22        # ... and the largest sparse size up to this
COMPRESSOR_NUMELS = (1 << 12, 1 << 16, 1 << 20, 1 << 22)
OWN_GRADIENT = 1 << 16      # gradients this large get their own compressor timings
REPEAT = 3
MAX_REPEAT = 25
LOADED_RUNS = 4     # collectives timed per point under the training thread's load, at least ...
MOST_LOADED_RUNS = 64   # ... and at most, however short they are against a step
MOST_SLOWDOWN = 8.0     # a slowdown larger than this is taken as this one (noise in a short overlap)
BUDGET = 0.2      # seconds of timed runs per point, at least
IN_BACKWARD_STEPS = 3   # steps timed per compressor inside backward after an untimed one, at least ...
MOST_IN_BACKWARD_STEPS = 24     # ... and at most, as many as fit in IN_BACKWARD_SECONDS
IN_BACKWARD_SECONDS = 3.0
PROFILE_BATCHES = 4     # batches made before anything is timed, then taken in turn (model_and_loss)
TIMELINE_WINDOWS = 3    # windows the backward timeline and a step's CPU are measured in (averaged_windows)
WINDOWED = ("ready", "backward_end", "optimizer", "forward", "cpu")     # what a window measures, by name
# of a collective, as costs.Costing reads them (its measurements alone and under load, then its CPU alone)
QUANTITIES = ("collectives", "loaded", "slowdown", "cpu_loaded", "cpu")


@dataclass(frozen=True)
class Sizes:
    """The sizes a model's curves are measured at: each size list above up to the model's whole
    gradient, which takes the place of the list's first point beyond it (_upto). No unit the planner
    prices is larger than the whole gradient, and a small model's profile no longer times 32 MB
    collectives: ncf's tiny test model profiled in 20.8 s with every size. Where the whole gradient is
    larger than a list's last point, a curve extends beyond it (costs.Curve): ncf's 6.6M elements,
    all in one unit under blocktopk, were priced by the line from 256K to 4M elements at 7.2 ms of
    CPU for their sparse AllReduce, where a profile measuring 6.6M found 5.1
    (docs/results/plan-3dfa44f-whole-grid)."""
    collective_bytes: tuple[int, ...]
    allgather_bytes: tuple[int, ...]
    sparse_numels: tuple[int, ...]
    compressor_numels: tuple[int, ...]

    @classmethod
    def of(cls, model: dict) -> "Sizes":
        """The sizes for a model's measurements (profile_model's first result)."""
        numel = sum(t["numel"] for t in model["tensors"].values())
        return cls(_upto(COLLECTIVE_BYTES, numel * ITEMSIZE), _upto(ALLGATHER_BYTES, numel * ITEMSIZE),
                   _upto(SPARSE_NUMELS, numel), _upto(COMPRESSOR_NUMELS, numel))


def _upto(points: tuple[int, ...], largest: int) -> tuple[int, ...]:
    """`points` below `largest`, then `largest` itself if the points reach it (else all of them); the
    first two points if fewer than one is below it (a curve needs two)."""
    below = tuple(p for p in points if p < largest)
    if len(below) == len(points):
        return points
    return below + (largest,) if below else points[:2]


def model_and_loss(cfg: dict, rank: int, world: int):
    """The model and a function giving the loss of its next batch: PROFILE_BATCHES batches made at
    once, then taken in turn, so that no measurement times the making of a batch, as `sparcoll
    train`'s steps do not (it makes each before the step's clock starts). vgg's batch takes 43 ms on
    one core, deeplight's 0.9 (docs/results/plan-9a6187c-fresh/batch_time.txt)."""
    if cfg.get("model_spec"):
        workload = UserModel(cfg["model_spec"])
        batches = workload.batches()
    else:
        workload = get_workload(cfg["workload"], data=cfg.get("data"), seed=cfg["seed"], **cfg["options"])
        batches = workload.batches(cfg["batch_size"], rank, world, cfg["seed"])
    made = itertools.cycle(list(itertools.islice(batches, PROFILE_BATCHES)))
    return workload.model, lambda m: workload.loss(m, next(made))


def training_step(model: nn.Module, loss_of):
    """One forward and backward of the model's next batch, as the load beside which the profile
    times what runs on a second thread."""
    def step() -> None:
        model.zero_grad()
        loss_of(model).backward()
    return step


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def slowest_and_mean(measured: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Times and CPU seconds (`measured[0]`, `measured[1]`, any shape) over every worker: the slowest
    worker's times (a collective, a step, ends with it) and the workers' mean CPU (what the cores
    serve, timeline.Step.cpu_bound)."""
    every = [torch.empty_like(measured) for _ in range(dist.get_world_size())]
    # contiguous: gloo reduced only part of a strided slice, without error
    dist.all_gather(every, measured.contiguous())
    every = torch.stack(every)
    return every[:, 0].max(dim=0).values, every[:, 1].mean(dim=0)


class Timing(NamedTuple):
    """A run's time (`seconds`) and the CPU seconds a worker's process spent in it, every thread
    (`cpu`: what timeline.Step.cpu_bound adds up)."""
    seconds: float
    cpu: float


SPEED: list[float] = []     # bench.speed's reference, timed before each measurement of this profile


def timed(run, prepare=lambda: None) -> Timing:
    """The median of the slowest worker's time over at least REPEAT runs after an untimed one, more
    for short ones (until BUDGET seconds or MAX_REPEAT runs: small collectives are noisy on a busy
    machine), and of the workers' mean CPU in them (the cores serve every worker: the busiest one's
    CPU, taken per measurement, added up to 4-7% more than any worker spent in a step); every run
    starts together, and every worker sees the same times, so all run as many."""
    times: list[float] = []
    cpus: list[float] = []
    SPEED.append(reference_cpu_s())
    for i in range(MAX_REPEAT + 1):
        arg = prepare()
        dist.barrier()
        cpu, start = time.process_time(), time.perf_counter()
        run(arg)
        if i:
            took, cpu = slowest_and_mean(torch.tensor([[time.perf_counter() - start],
                                                       [time.process_time() - cpu]], dtype=torch.float64))
            times.append(took.item())
            cpus.append(cpu.item())
            if len(times) >= REPEAT and sum(times) >= BUDGET:
                break
    return Timing(statistics.median(times), statistics.median(cpus))


class Together:
    """backward_timeline's iterations as training runs its steps: started together on every worker
    (a barrier), each point timed when the slowest worker reached it, from the moment the first
    worker started. The workers of a profile share one host (sparcoll plan runs them there), hence
    one monotonic clock: perf_counter's times compare across them."""

    def start(self) -> None:
        dist.barrier()

    def most(self, seconds: float) -> float:
        return slowest(seconds)

    def slowest(self, times: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        first = starts.clone()
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        shifted = times + (starts - first)[:, None]
        dist.all_reduce(shifted, op=dist.ReduceOp.MAX)
        return shifted


def profile_model(cfg: dict, model: nn.Module, loss_of, world: int, comm) -> tuple[dict, dict, dict]:
    """The model's measurements, its large dense gradients (for the compressors' timing) and its
    sparse COO gradients as backward left them, uncoalesced (for profile_coo). A trainable parameter
    backward gives no gradient (unused in forward) is left out, named under "unused": there is
    nothing of it to synchronize (DataParallel sends nothing for it either)."""
    block_size = comm.block_size
    rows = {}
    hooks = [layer.register_forward_pre_hook(
        lambda layer, args: rows.__setitem__(id(layer.weight), rows.get(id(layer.weight), 0)
                                             + args[0].numel() // layer.in_features))
        for layer in eligible_layers(model)]
    model.zero_grad()
    loss_of(model).backward()
    for hook in hooks:
        hook.remove()
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    params = {name: p for name, p in trainable.items() if p.grad is not None}
    masks = [BlockTensor((p.grad.to_dense() if p.grad.is_sparse else p.grad).reshape(-1).float(), block_size)
             for p in params.values()]
    local = [b.nonzero().size / max(1, b.nblocks) for b in masks]
    marks = torch.cat([torch.from_numpy(np.isin(np.arange(b.nblocks), b.nonzero())).float() for b in masks])
    dist.all_reduce(marks, op=dist.ReduceOp.MAX)
    sizes = [b.nblocks for b in masks]
    union = [part.mean().item() if part.numel() else 0.0 for part in marks.split(sizes)]
    density = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(density)
    # the gradients themselves, not copies: zero_grad lets the model go of them (vgg's 800 MB, with
    # every worker on one host)
    gradients = {name: p.grad.detach() for name, p in params.items()
                 if p.numel() >= OWN_GRADIENT and not p.grad.is_sparse}
    coo_gradients = {name: p.grad.detach() for name, p in params.items() if p.grad.is_sparse}
    model.zero_grad()
    timeline = together_timeline(cfg, model, loss_of)
    node = layer_backward(timeline)
    by_name = {f.name: f for f in facts(model)}
    sfb_able = [name for name, p in params.items() if by_name[name].linear and rows.get(id(p))]
    sfb = {}
    if sfb_able:
        skipping = together_timeline(cfg, model, loss_of, skipped=frozenset(sfb_able))
        spared = spared_in_backward(timeline, skipping, node)
        train_step = training_step(model, loss_of)
        alone_step = timed(lambda _: train_step()).seconds
        sfb = {name: {"spared": spared.get(name, 0.0),
                      **rebuild_beside_training(params[name].shape, rows[id(params[name])], world, train_step,
                                                alone_step, cfg["timeout"])}
               for name in sfb_able}
        model.zero_grad()
    lookups = lookup_names(model) & params.keys()
    spared_lookups = spared_by_lookups(cfg, model, loss_of, timeline, lookups) if lookups else {}
    tensors = {name: {"numel": p.numel(), "shape": list(p.shape), "linear": by_name[name].linear,
                      "coo": by_name[name].coo, "rows": rows.get(id(p), 0),
                      "density": d / world, "union": u, "node": node.get(name, 0.0), **sfb.get(name, {}),
                      **spared_lookups.get(name, {})}
               for (name, p), d, u in zip(params.items(), density.tolist(), union)}
    unused = [name for name in trainable if name not in params]
    return {**window(timeline), "tensors": tensors, "unused": unused}, gradients, coo_gradients


def together_timeline(cfg: dict, model: nn.Module, loss_of, skipped: frozenset = frozenset()) -> BackwardProfile:
    """The model's backward timeline as the profile measures it: every worker's iterations together."""
    return backward_timeline(model, loss_of, iterations=cfg.get("iterations", 5), peers=Together(), skipped=skipped)


def window(timeline: BackwardProfile) -> dict:
    """A backward timeline as the profile stores it (a window's, with its step's CPU beside)."""
    return {"order": list(timeline.order), "ready": list(timeline.step.ready),
            "backward_end": timeline.step.backward_end, "optimizer": timeline.step.optimizer,
            "forward": timeline.forward}


def another_window(cfg: dict, model: nn.Module, loss_of) -> dict:
    """The backward timeline and a step's CPU measured again, later in the profile."""
    return {**window(together_timeline(cfg, model, loss_of)), "cpu": step_cpu(model, loss_of)}


def averaged_windows(model: dict, windows: list[dict]) -> dict:
    """The model's measurements (the "model" event: the first window) with each WINDOWED quantity the
    mean over it and the later `windows`, each window's own kept under "windows". The same step read
    14.0-18.8 ms (forward, backward and optimizer) in windows of 1 s within one job of 4 workers of ncf,
    drifting over tens of seconds (docs/results/timeline-windows): one window reads one moment."""
    every = [model, *windows]
    if any(w["order"] != model["order"] for w in windows):
        raise RuntimeError("the model's gradients became ready in different orders in the profile's windows")
    mean = {key: statistics.fmean(w[key] for w in every) for key in WINDOWED if key != "ready"}
    return {**model, **mean, "ready": [statistics.fmean(times) for times in zip(*(w["ready"] for w in every))],
            "windows": [{key: w[key] for key in WINDOWED} for w in every]}


def step_cpu(model: nn.Module, loss_of) -> float:
    """The CPU seconds of one training step (forward, backward, the optimizer) on a worker (their
    mean), every worker stepping at once: the work no strategy takes off the cores (ncf: 6.9 ms,
    4 workers on 2 cores, docs/results/cpu-per-step/ncf-profile.json)."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)

    def step(_) -> None:
        optimizer.zero_grad()
        loss_of(model).backward()
        optimizer.step()
    try:
        return timed(step).cpu
    finally:
        optimizer.zero_grad()


def cores_per_worker(world: int) -> float:
    """The CPU cores each worker of this machine has (the cores this process may use, shared by the
    job's workers on the same host)."""
    hosts: list = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    return cores_each(hosts.count(socket.gethostname()))


def cores_each(workers_here: int) -> float:
    """The cores this process may use, shared by `workers_here` workers on this host."""
    return len(os.sched_getaffinity(0)) / workers_here


def layer_backward(timeline: BackwardProfile) -> dict:
    """How long each SFB-able layer's backward takes from its output gradient (when SFB's factors
    are ready) to its weight gradient."""
    ready = dict(zip(timeline.order, timeline.step.ready))
    return {name: ready[name] - at for name, at in timeline.output_gradient.items() if name in ready}


def spared_in_backward(full: BackwardProfile, skipping: BackwardProfile, node: dict) -> dict:
    """Each SFB-able layer's weight gradient's time in backward (what SFB spares it), from the same
    backward measured with every such layer's weight gradient skipped (`skipping`): the layers in
    backward order, each layer's share is how much sooner the next layer's output gradient (after
    the last, backward's end) arrives when skipping, less the layers' before it; at most the
    layer's `node` (its output gradient to its weight gradient). Timed apart from backward, the
    product took more than the whole node on vgg (1.27 s against 0.79: 4096 x 25088 from 32 rows,
    every worker at once), and backward ended before it began in the plan's timeline."""
    layers = sorted((name for name in node if name in skipping.output_gradient),
                    key=lambda name: full.output_gradient[name])
    if not layers:
        return {}

    def sooner(k: int) -> float:
        """How much sooner, when skipping, the point after layer k is reached (k = -1: layer 0's
        output gradient, the common start)."""
        if k < 0:
            return full.output_gradient[layers[0]] - skipping.output_gradient[layers[0]]
        if k + 1 < len(layers):
            return full.output_gradient[layers[k + 1]] - skipping.output_gradient[layers[k + 1]]
        return full.step.backward_end - skipping.step.backward_end
    return {name: min(node[name], max(0.0, sooner(k) - sooner(k - 1))) for k, name in enumerate(layers)}


def lookup_names(model: nn.Module) -> set[str]:
    """The names of the weights of `model`'s embeddings declared dense (sparse.dense_lookups)."""
    weights = {id(m.weight) for m in sparse.dense_lookups(model)}
    return {name for name, p in model.named_parameters() if id(p) in weights}


@contextlib.contextmanager
def looked_up_sparse(model: nn.Module):
    """The model's embeddings declared dense looking their rows up sparse, as DataParallel runs them
    when the sparse AllReduce takes their weights (sparse.Lookups)."""
    lookups = sparse.Lookups(model, lambda weight: weight.requires_grad)
    try:
        yield
    finally:
        for handle in lookups.handles:
            handle.remove()


def spared_by_lookups(cfg: dict, model: nn.Module, loss_of, timeline: BackwardProfile, lookups: set[str]) -> dict:
    """Per weight of `lookups`, the backward time (`lookup_spared`) and CPU (`lookup_spared_cpu`) its
    rows looked up sparse spare: backward no longer zeroes the whole table to add the rows into it
    (deeplight's 68 MB, 4.0 ms a step on one core, docs/results/lookups-dc528c2). The time from the
    backward timeline measured again so (`timeline` is the one measured dense just before), the CPU
    from a forward and backward's, both ways, shared among the weights as their time is."""
    def backward(_) -> None:
        loss_of(model).backward()
    dense_cpu = timed(backward, model.zero_grad).cpu
    with looked_up_sparse(model):
        looked_up = together_timeline(cfg, model, loss_of)
        sparse_cpu = timed(backward, model.zero_grad).cpu
    model.zero_grad()
    spared = spared_in_order(timeline, looked_up, lookups)
    total, cpu = sum(spared.values()), max(0.0, dense_cpu - sparse_cpu)
    return {name: {"lookup_spared": seconds, "lookup_spared_cpu": cpu * seconds / total if total > 0 else 0.0}
            for name, seconds in spared.items()}


def spared_in_order(full: BackwardProfile, lighter: BackwardProfile, names: set[str]) -> dict:
    """Each of `names`' share of backward that `lighter` (the same backward with less work in some
    gradients) spares: in full's backward order, how much sooner its gradient is ready than in full,
    less how much sooner the gradient before it was (never below 0: noise)."""
    ready = dict(zip(lighter.order, lighter.step.ready))
    spared, before = {}, 0.0
    for name, at in zip(full.order, full.step.ready):
        if name not in ready:
            continue
        sooner = at - ready[name]
        if name in names:
            spared[name] = max(0.0, sooner - before)
        before = sooner
    return spared


def rebuild_beside_training(shape, rows: int, world: int, train_step, alone_step: float, timeout: float) -> dict:
    """SFB's rebuild of a weight of `shape` whose layer saw `rows` rows from every worker's factors
    (K x workers rows, written into a preallocated gradient as sfb.LinearState does), alone
    (`rebuild`) and on a second thread while this one trains (`rebuild_loaded`), every worker at
    once: the synchronization thread rebuilds while backward computes the layers before (vgg's
    output layer: 0.94-1.10 s in training, 0.54 priced alone). Backward slows as much as the product
    (`rebuild_slowdown`, loaded / alone): two compute-bound threads share the cores alike. The steps'
    own slowdown, measured whole as a collective's is, said 8x (its cap) on vgg, where one step
    spanned all the rebuilds; its backward under SFB ran 2-3x its time alone in training."""
    m, n = shape
    big_u, big_v, result = torch.randn(rows * world, m), torch.randn(rows * world, n), torch.empty(m, n)
    run = lambda _: torch.mm(big_u.t(), big_v, out=result)     # noqa: E731
    alone, loaded, _, cpu_loaded = alone_and_loaded(run, lambda: None, train_step, alone_step, timeout)
    return {"rebuild": alone.seconds, "rebuild_loaded": loaded,
            "rebuild_slowdown": max(1.0, loaded / max(alone.seconds, 1e-12)), "rebuild_cpu": alone.cpu,
            "rebuild_cpu_loaded": cpu_loaded}


def decompress_into(compressor, payload, world: int, into: torch.Tensor) -> None:
    """What the synchronization thread computes on a payload after its collective: an allgather
    scheme combines every rank's parts (here this rank's, `world` times), any other decompresses
    into the gradient-sized `into`, as the executors do."""
    if compressor.scheme == "allgather":
        compressor.combine([payload.parts] * world, payload.ctx, into)
    else:
        compressor.decompress(payload.parts, payload.ctx, into)


def profile_compressors(specs: list[str], world: int, gradients: dict, numels: tuple[int, ...]):
    """(spec, numel, tensor name or None, compress Timing, decompress Timing), on random tensors of
    `numels` elements (the curves) and on the model's own large gradients (a compressor's time
    depends on the data: sampled thresholds, ties, momentum). The decompression is what each scheme runs
    after its collective (allreduce: decompress the average; allgather: combine every rank's parts; the
    sparse AllReduce: its blocks into a dense tensor); PowerSGD's whole reduction, its allreduces
    included. On a model's gradient, the times of a compressor a plan runs in backward are priced
    from compress_in_backward instead: these are kept as "compress_alone" and "decompress_alone".
    """
    samples = [(None, torch.randn(numel)) for numel in numels] + list(gradients.items())
    for spec in specs:
        release_freed_memory()      # the last compressor's (its memory, its scratch)
        reducer = Reducer(spec, check_sizes=False)     # (every rank times the same sizes)
        c = reducer.compressor
        for name, x in samples:
            if c.scheme == "powersgd":      # computes between its allreduces: timed whole, with them,
                # its product written into a gradient-sized tensor, as the executors have it
                into = [torch.empty(x.numel())]
                yield spec, x.numel(), name, timed(lambda _: reducer.reduce_many(
                    [x], [name or x.numel()], into=into)), Timing(0.0, 0.0)
                continue
            last = [None]       # only the last run's payload is kept: vgg's layer has 205 MB under fp16
            compress = timed(lambda _: last.__setitem__(0, reducer.compress(x, key=name or x.numel())))
            payload = last.pop()
            # into a gradient-sized tensor, as the executors decompress: a new one each time took
            # 55 ms for deeplight's 68 MB embedding gradient (fresh pages) under blocktopk, about ten
            # times its time in place
            into = torch.empty(x.numel())
            decompress = timed(lambda _: decompress_into(c, payload, world, into))
            yield spec, x.numel(), name, compress, decompress


def in_backward(specs: list[str]) -> list[str]:
    """The compressors a plan runs in backward: every one that compresses apart from its collective
    (all but PowerSGD)."""
    return [spec for spec in specs if Reducer(spec).splits]


def in_backward_steps(untimed: float) -> int:
    """How many steps compress_in_backward times after an untimed one of `untimed` seconds: as many
    as fit in IN_BACKWARD_SECONDS, at least IN_BACKWARD_STEPS, at most MOST_IN_BACKWARD_STEPS. On 4
    workers sharing 2 cores one compressor's time in a step of gpt moved up to 4x from step to step
    (blocktopk 12-46 ms, efsignsgd 32-113), and the median of 3 steps read blocktopk's total at 26-62
    ms in six profiles; vgg's steps of a second and more stay at 3."""
    return runs_that_fit(IN_BACKWARD_SECONDS, untimed, IN_BACKWARD_STEPS, MOST_IN_BACKWARD_STEPS)


def compress_in_backward(specs: list[str], world: int, model: nn.Module, loss_of, names: list[str],
                         timeout: float):
    """(spec, tensor name, compress Timing, decompress Timing) of each compressor that compresses
    apart from its collective, on each of the model's dense gradients `names`, timed where
    sparcoll.torch.DataParallel runs it under a plan: in backward, on the training thread, the moment
    the gradient is ready, every worker training with the same compressor, and a second thread
    decompressing each payload into its gradient as it comes, as the synchronization thread does
    after each collective (ncf's largest gradient under efsignsgd: 27-30 ms in training, 22 in the
    profile apart from training; gpt's LayerNorm gradients under blocktopk: 0.12-0.16 ms each in
    training, 0.27 timed apart, where 4 workers start at once after a barrier). Per compressor an
    untimed step, then as many as in_backward_steps says from its length; per step the slowest
    worker's time and the workers' mean CPU of the thread that ran it, the median of each over the
    steps."""
    if not names:
        return
    params = dict(model.named_parameters())
    channel = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sparcoll-profile-channel")
    try:
        for spec in in_backward(specs):
            release_freed_memory()      # the last compressor's
            reducer = Reducer(spec, check_sizes=False)
            # per step and gradient: (the compression's, the decompression's) time, then thread CPU
            times = torch.zeros(2, 2, 1 + MOST_IN_BACKWARD_STEPS, len(names), dtype=torch.float64)
            step, pending = 0, []

            def decompress(payload, into: torch.Tensor, step: int, j: int) -> None:
                cpu, start = time.thread_time(), time.perf_counter()
                decompress_into(reducer.compressor, payload, world, into)
                times[:, 1, step, j] = torch.tensor([time.perf_counter() - start, time.thread_time() - cpu])

            def hook_for(j: int, name: str):
                def hook(p: torch.Tensor) -> None:
                    cpu, start = time.thread_time(), time.perf_counter()
                    payload = reducer.compress(p.grad, key=name)
                    times[:, 0, step, j] = torch.tensor([time.perf_counter() - start, time.thread_time() - cpu])
                    # into the gradient itself where the executor decompresses there
                    into = p.grad.view(-1) if takes_average_in_place(p.grad) else torch.empty(p.grad.numel())
                    pending.append(channel.submit(decompress, payload, into, step, j))
                return hook

            handles = [params[name].register_post_accumulate_grad_hook(hook_for(j, name))
                       for j, name in enumerate(names)]

            def train() -> float:
                dist.barrier()
                start = time.perf_counter()
                model.zero_grad()
                loss_of(model).backward()
                for done in pending:
                    done.result(timeout)
                pending.clear()
                return time.perf_counter() - start

            try:
                count = in_backward_steps(slowest(train()))     # step 0: untimed, every worker's count
                for step in range(1, 1 + count):
                    train()
            finally:
                for handle in handles:
                    handle.remove()
            seconds, cpus = slowest_and_mean(times[:, :, 1:1 + count])
            seconds, cpus = seconds.median(dim=1).values, cpus.median(dim=1).values
            for j, name in enumerate(names):
                yield spec, name, Timing(seconds[0, j].item(), cpus[0, j].item()), \
                    Timing(seconds[1, j].item(), cpus[1, j].item())
    finally:
        channel.shutdown(cancel_futures=True)


def profile_coo(comm, specs: list[str], coo_gradients: dict, train_step, timeout: float, order: list[str]):
    """(option, tensor name, Timing alone, seconds under load, slowdown of a training step, CPU seconds
    under load) for each of the model's sparse COO gradients under each option it can take
    (options.coo_labels), measured whole on the gradient itself as sparcoll.torch.DataParallel runs it:
    coalesced, its entries compressed, its collective. A COO gradient's cost is its rows, not its dense
    size: deeplight's embedding (17M elements) touches 3% of its blocks per worker, and gloo's gathers
    of them were priced as a dense ring (1 s predicted for a step that trains in about 0.11 s). Then the
    sparse AllReduce of each unit of several (fusion.coo_units, in backward order `order`) as one
    collective, named by their names joined by "+": every collective has a fixed cost besides its rows
    (ncf's four embeddings took 3.4-5.8 ms each at 1 Gbit/s, their rows 1-2 ms of it)."""
    alone_step = timed(lambda _: train_step()).seconds
    group = Channel(None)       # the group's own sparse all_reduce: gloo's gathers
    uncompressed = {RING: group.sparse_mean, SPARSE: lambda t: comm.allreduce_coo(t, op="avg")}
    for name, g in coo_gradients.items():
        for label in coo_labels(specs):
            reduce = uncompressed.get(label) or functools.partial(
                Reducer(label, None, comm, check_sizes=False).reduce, key=name)
            run = lambda _, g=g, reduce=reduce: reduce(g.coalesce())      # noqa: E731
            yield label, name, *alone_and_loaded(run, lambda: None, train_step, alone_step, timeout)
    for names in coo_units(order, set(coo_gradients)):
        run = lambda _, grads=[coo_gradients[n] for n in names]: sparse.allreduce_many(grads, "avg", comm)  # noqa: E731
        yield SPARSE, "+".join(names), *alone_and_loaded(run, lambda: None, train_step, alone_step, timeout)


def collectives(comm, block_size: int, rank: int, world: int, sizes: Sizes):
    """(collective, x as costs.py defines it, the tensor's elements for the sparse AllReduce's grid
    (else None), run, prepare): what profile_collectives times."""
    channel = Channel(None, comm)
    for size in sizes.collective_bytes:
        x = torch.randn(size // 4)
        yield RING, size, None, channel.allreduce_mean, x.clone
        scratch = [torch.empty(-(-x.numel() // world)) for _ in range(world - 1)]
        yield PS, size, None, lambda t, scratch=scratch: ps_allreduce(t, None, scratch), x.clone
    for size in sizes.allgather_bytes:
        x = torch.randn(size // 4)
        yield ALLGATHER, size, None, lambda _, x=x: channel.allgather((x,), variable=False), lambda: None
    for numel in sizes.sparse_numels:
        for density in SPARSE_DENSITIES:
            x, local, union = sparse_input(numel, density, block_size, rank, world)
            yield SPARSE, sparse_volume(numel, local, union), numel, lambda t: comm.allreduce(t, op="avg"), \
                x.clone
    for numel in sizes.sparse_numels:
        for share in BLOCK_SHARES:
            blocks, local, union = kept_blocks(numel, share, block_size, rank, world)
            yield BLOCKS, sparse_volume(numel, local, union), None, channel.sparse_mean, lambda b=blocks: b


def _kept(numel: int, density: float, block_size: int, world: int) -> list[np.ndarray]:
    """Each rank's random choice of blocks, each kept with probability `density` (at least one)."""
    nblocks = -(-numel // block_size)
    kept = [np.random.default_rng(r + 1000 * numel).random(nblocks) < density for r in range(world)]
    for r, k in enumerate(kept):
        k[r % nblocks] |= not k.any()
    return kept


def sparse_input(numel: int, density: float, block_size: int, rank: int, world: int):
    """This rank's input of random blocks kept with probability `density` (each rank its own), and
    the mean local and the union block density over the ranks."""
    kept = _kept(numel, density, block_size, world)
    mask = torch.from_numpy(np.repeat(kept[rank], block_size)[:numel])
    return torch.randn(numel) * mask, *_densities(kept)


def kept_blocks(numel: int, density: float, block_size: int, rank: int, world: int):
    """The blocks sparse_input keeps, as a sparse-scheme compressor's payload travels: a COO tensor of
    their rows (Channel.blocks_mean; the last block whole, zero-padded); and the same densities."""
    kept = _kept(numel, density, block_size, world)
    indices = torch.from_numpy(np.flatnonzero(kept[rank]))
    return block_rows(indices, torch.randn(len(indices), block_size), len(kept[rank])), *_densities(kept)


def _densities(kept: list[np.ndarray]) -> tuple[float, float]:
    """The mean local and the union block density over the ranks."""
    return float(np.mean([k.mean() for k in kept])), float(np.mean(np.logical_or.reduce(kept)))


def held_beside(comm, block_size: int, rank: int, world: int, sizes: Sizes):
    """(bytes, seconds) for each ring allreduce of at most HELD_BYTES: how much later a sparse
    AllReduce started right after it finishes than alone, as DataParallel runs an uncompressed tensor
    on the ring (started on gloo's threads, the synchronization thread going on to the next tensor).
    Its bytes on the link are the least of it on a busy machine: with ncf's MLP on the ring beside its
    embeddings' sparse AllReduce, priced by its link share, the model put a plan 6% ahead of uniform
    sparse that ran 3-7% behind it. 4 workers on 2 cores at 1 Gbit/s: 0.9 ms after a 4 KB ring, 2.2
    after 64 KB, where their link shares are 0.05 and 0.8. Larger rings are mostly their bytes on
    the link."""
    channel = Channel(None, comm)
    x = sparse_input(min(sizes.sparse_numels[-1], HELD_NUMEL), HELD_DENSITY, block_size, rank, world)[0]
    alone = timed(lambda t: comm.allreduce(t, op="avg"), x.clone).seconds
    for size in sizes.collective_bytes:
        if size > HELD_BYTES:
            break
        ring, started = torch.randn(size // 4), []

        def prepare(ring=ring, started=started):
            while started:
                started.pop().wait()
            return ring.clone(), x.clone()

        def run(tensors, started=started):
            started.append(channel.start_allreduce_mean(tensors[0]))
            comm.allreduce(tensors[1], op="avg")

        after = timed(run, prepare).seconds
        prepare()
        yield size, max(0.0, after - alone)


def profile_sparse_own(comm, gradients: dict, tensors: dict, lookups: set[str], train_step, timeout: float):
    """(tensor name, Timing alone, seconds under load, slowdown of a training step, CPU seconds under
    load) of the sparse AllReduce, as the executor runs it, on each of the model's large dense gradients
    that are not dense (its union below 1): the executor's algorithm changes with size and density (a
    4M-element tensor at 30% took gloo's ring, a 1M-element one the sparse AllReduce), so the grid of
    random tensors between them priced deeplight's 1M-element linear layer at 40 ms, measured 13. The
    weights of `lookups` (embeddings declared dense) go as DataParallel sends them under it: their
    rows as COO, the sum written into a table kept from run to run (sparse.Lookups, KeptTables)."""
    alone_step = timed(lambda _: train_step()).seconds
    dense = lambda t: comm.allreduce(t, op="avg")     # noqa: E731
    tables = sparse.KeptTables()
    for name, g in gradients.items():
        if tensors[name]["union"] < 1.0:
            if name in lookups:
                run = lambda t, key=name: tables.write(key, comm.allreduce_coo(t, op="avg"))     # noqa: E731
                prepare = functools.partial(g.to_sparse, 1)
            else:
                run, prepare = dense, g.clone
            yield name, *alone_and_loaded(run, prepare, train_step, alone_step, timeout)


def profile_collectives(comm, block_size: int, rank: int, world: int, sizes: Sizes, train_step, timeout: float):
    """(collective, x, elements or None (as `collectives`), Timing alone, seconds under load,
    slowdown of a training step, CPU seconds under load) for each; see `under_load`."""
    alone_step = timed(lambda _: train_step()).seconds
    for kind, x, numel, run, prepare in collectives(comm, block_size, rank, world, sizes):
        yield kind, x, numel, *alone_and_loaded(run, prepare, train_step, alone_step, timeout)


def alone_and_loaded(run, prepare, train_step, alone_step: float,
                     timeout: float) -> tuple[Timing, float, float, float]:
    """run(prepare())'s time and CPU alone (`timed`), then its time under load, the steps' slowdown
    and its CPU under load (`under_load`)."""
    alone = timed(run, prepare)
    return alone, *under_load(run, prepare, train_step, alone_step, alone.seconds, timeout)


def under_load(run, prepare, train_step, alone_step: float, alone: float,
               timeout: float) -> tuple[float, float, float]:
    """run(prepare())'s median time on a second thread while this one runs train_step back to back (at
    least once), how many times longer the steps' work took while the collectives ran than `alone_step`
    (the slowest worker's), and the CPU seconds a run took meanwhile (the workers' mean): the process's
    CPU over the runs less this thread's (read from the second thread) and less the inputs' preparation.
    Beside training a collective's threads spend more CPU than alone (ncf's four embeddings under the
    sparse AllReduce: 1.23x, docs/results/collective-cpu-loaded), and in training they run beside it.
    The collectives run at least LOADED_RUNS times, and as many as their time `alone` needs to span a
    step alone (the same count on every worker: both times are the slowest worker's): a step measured
    whole against collectives that covered a third of it said a third of their slowdown (deeplight's
    160K-element sparse layers, 1.2-1.5x, where its backward in training took 2.7x as long under them as
    under one ring allreduce). The steps' time outside the collectives counts at their rate alone
    (`slowed`)."""
    times: list[float] = []
    span: list[float] = []
    cpu: list[float] = []
    failure: list[BaseException] = []
    done = threading.Event()
    runs = max(LOADED_RUNS, min(MOST_LOADED_RUNS, math.ceil(alone_step / max(alone, 1e-6))))
    trainer = time.pthread_getcpuclockid(threading.get_ident())

    def loop() -> None:
        began, process, training = time.perf_counter(), time.process_time(), time.clock_gettime(trainer)
        preparing = 0.0     # the inputs' copies: not the collective's (`timed` leaves them out too)
        try:
            for _ in range(runs):
                before = time.thread_time()
                arg = prepare()
                preparing += time.thread_time() - before
                start = time.perf_counter()
                run(arg)
                times.append(time.perf_counter() - start)
            cpu.append(((time.process_time() - process) - (time.clock_gettime(trainer) - training) - preparing)
                       / runs)
        except BaseException as exc:        # reaches the training thread, which raises it
            failure.append(exc)
        finally:
            span[:] = [began, time.perf_counter()]
            done.set()

    dist.barrier()
    thread = threading.Thread(target=loop, name="sparcoll-profile-load", daemon=True)
    thread.start()
    steps, start = 0, time.perf_counter()
    while (not done.is_set() or not steps) and time.perf_counter() - start < timeout:
        train_step()
        steps += 1
    elapsed = time.perf_counter() - start
    thread.join(max(0.0, timeout - elapsed))
    if failure:
        raise failure[0]
    if not done.is_set():
        raise sparcoll.CollectiveTimeout(f"collectives under load did not finish within {timeout:g} s")
    overlap = min(span[1], start + elapsed) - max(span[0], start)
    measured = torch.tensor([[statistics.median(times), slowed(overlap, elapsed, steps * alone_step)],
                             [max(0.0, cpu[0]), 0.0]], dtype=torch.float64)
    slowest, mean = slowest_and_mean(measured)
    return slowest[0].item(), slowest[1].item(), mean[0].item()


def slowed(overlap: float, elapsed: float, work: float) -> float:
    """How many times longer the steps' work took during `overlap` seconds of their `elapsed`: they
    did `work` seconds of work alone in all, at their rate alone outside the overlap (at least 1,
    at most MOST_SLOWDOWN: the steps' time alone is a median, the rest noise)."""
    during = work - (elapsed - overlap)       # the work done while the collectives ran
    if overlap <= 0:
        return 1.0
    return MOST_SLOWDOWN if during <= overlap / MOST_SLOWDOWN else max(1.0, overlap / during)


def fit(events: list[dict]) -> dict:
    """What costs.Costing takes, from the profile's measurement events: a curve per quantity (points
    on random tensors; contention's not made monotone: one noisy point would lift every larger size),
    the sparse AllReduce's as grids by elements and share (costs.Grid, under "grids"), and the times
    on the model's own gradients by tensor name (KIND_own: the compressors'; a COO gradient's options
    whole, alone and under load; the sparse AllReduce on a large dense gradient that is not dense,
    alone and under load)."""
    points: dict = {}
    grid_points: dict = {}
    out: dict = {"collectives": {}, "compress": {}, "decompress": {}, "compress_own": {}, "decompress_own": {},
                 "loaded": {}, "slowdown": {}, "held": {}, "grids": {}, "cpu": {}, "cpu_loaded": {}, "compress_cpu": {},
                 "decompress_cpu": {}}
    for e in events:
        if e.get("tensor"):
            out.setdefault(f"{e['kind']}_own", {}).setdefault(e["what"], {})[e["tensor"]] = e["seconds"]
        elif "numel" in e:
            grid_points.setdefault((e["kind"], e["what"]), []).append(
                (e["numel"], e["x"] / (e["numel"] * ITEMSIZE), e["seconds"]))
        else:
            points.setdefault((e["kind"], e["what"]), []).append((e["x"], e["seconds"]))
    for (kind, what), pts in points.items():
        curve = Curve.of(pts, monotone=kind not in ("loaded", "slowdown", "held"))
        out[kind][what] = [list(curve.xs), list(curve.ys)]
    for (kind, what), pts in grid_points.items():
        out["grids"].setdefault(kind, {})[what] = Grid.of(pts, monotone=kind in MONOTONE).rows()
    return out


def timed_compressors(cfg: dict) -> list[str]:
    """The compressors whose times are measured (every one but none)."""
    return [s for s in cfg.get("compressors", COMPRESSORS) if s != "none"]


def events_after_model(cfg: dict, model: dict) -> int:
    """How many events a profile reports after its "model" event (for progress): the curves' points
    at the model's sizes and the times on its own large dense gradients and its COO ones."""
    sizes = Sizes.of(model)
    tensors = model["tensors"].values()
    large = [t for t in tensors if t["numel"] >= OWN_GRADIENT and not t["coo"]]
    dense = [t for t in tensors if not t["coo"]]
    coo = {name for name, t in model["tensors"].items() if t["coo"]}
    compressors = len(timed_compressors(cfg))
    measured = len(QUANTITIES)      # a collective's (and a COO option's) events, alone and under load
    return (4 * compressors * (len(sizes.compressor_numels) + len(large))
            + 4 * len(in_backward(timed_compressors(cfg))) * len(dense)
            + measured * sum(t["union"] < 1.0 for t in large)
            + measured * (len(coo_labels(timed_compressors(cfg))) * len(coo) + len(coo_units(model["order"], coo)))
            + measured * (2 * len(sizes.collective_bytes) + len(sizes.allgather_bytes)
                          + len(sizes.sparse_numels) * (len(SPARSE_DENSITIES) + len(BLOCK_SHARES)))
            + sum(size <= HELD_BYTES for size in sizes.collective_bytes)
            + TIMELINE_WINDOWS - 1)


def run_profile(cfg: dict, rank: int, world: int, comm) -> None:
    block_size = comm.block_size
    say = emit if rank == 0 else (lambda event: None)
    model, loss_of = model_and_loss(cfg, rank, world)
    measured, gradients, coo_gradients = profile_model(cfg, model, loss_of, world, comm)
    say({"event": "model", **measured, "cpu": step_cpu(model, loss_of), "cores_per_worker": cores_per_worker(world),
         "block_size": block_size})     # the sparse AllReduce's, which its curves are measured at
    sizes = Sizes.of(measured)
    specs = timed_compressors(cfg)
    priced_in_backward = in_backward(specs)
    for spec, numel, name, compress, decompress in profile_compressors(specs, world, gradients,
                                                                       sizes.compressor_numels):
        alone = "_alone" if name and spec in priced_in_backward else ""
        for kind, timing in ((f"compress{alone}", compress.seconds), (f"decompress{alone}", decompress.seconds),
                             (f"compress_cpu{alone}", compress.cpu), (f"decompress_cpu{alone}", decompress.cpu)):
            say({"event": "point", "kind": kind, "what": spec, "x": numel, "tensor": name, "seconds": timing})
    # from here on only the gradients profile_sparse_own times stay: the others were vgg's 836 MB a
    # worker beside the gradients its steps inside backward compute, the profile's peak (a worker
    # killed by the OOM killer at 6.6-6.97 GB in those phases, 4 workers on 24 GB)
    gradients = {name: g for name, g in gradients.items() if measured["tensors"][name]["union"] < 1.0}
    dense = {name: t["numel"] for name, t in measured["tensors"].items() if not t["coo"]}
    for spec, name, compress, decompress in compress_in_backward(specs, world, model, loss_of, list(dense),
                                                                 cfg["timeout"]):
        for kind, seconds in (("compress", compress.seconds), ("compress_cpu", compress.cpu),
                              ("decompress", decompress.seconds), ("decompress_cpu", decompress.cpu)):
            say({"event": "point", "kind": kind, "what": spec, "x": dense[name], "tensor": name, "seconds": seconds})
    release_freed_memory()      # the compressors' memories and payloads
    if TIMELINE_WINDOWS > 1:    # a window in the middle, the others at the end
        say({"event": "window", **another_window(cfg, model, loss_of)})
    train_step = training_step(model, loss_of)
    for label, name, alone, *times in profile_coo(comm, specs, coo_gradients, train_step, cfg["timeout"],
                                                  measured["order"]):
        for kind, seconds in zip((*COO_KINDS, "coo_cpu_loaded", "coo_cpu"), (alone.seconds, *times, alone.cpu)):
            say({"event": "point", "kind": kind, "what": label, "x": 0, "tensor": name, "seconds": seconds})
    for name, alone, *times in profile_sparse_own(comm, gradients, measured["tensors"], lookup_names(model),
                                                  train_step, cfg["timeout"]):
        for quantity, seconds in zip(QUANTITIES, (alone.seconds, *times, alone.cpu)):
            say({"event": "point", "kind": quantity, "what": SPARSE, "x": 0, "tensor": name, "seconds": seconds})
    for kind, x, numel, alone, *times in profile_collectives(comm, block_size, rank, world, sizes, train_step,
                                                             cfg["timeout"]):
        for quantity, seconds in zip(QUANTITIES, (alone.seconds, *times, alone.cpu)):
            say({"event": "point", "kind": quantity, "what": kind, "x": x, "seconds": seconds,
                 **({} if numel is None else {"numel": numel})})
    for x, seconds in held_beside(comm, block_size, rank, world, sizes):
        say({"event": "point", "kind": "held", "what": RING, "x": x, "seconds": seconds})
    for _ in range(TIMELINE_WINDOWS - 2):
        say({"event": "window", **another_window(cfg, model, loss_of)})
    # the machine's speed over the profile (the ranks' mean of their medians): what its times hold for
    speed = torch.tensor([statistics.median(SPEED)], dtype=torch.float64)
    dist.all_reduce(speed)
    say({"event": "speed", "reference_cpu_s": speed.item() / world})


def profile_job(cfg: dict, rank: int, world: int) -> None:
    comm = sparcoll.init(timeout=cfg["timeout"])      # as sparcoll train's executor gets it
    try:
        run_profile(cfg, rank, world, comm)
    finally:
        comm.close()


def main(argv: list[str] | None = None) -> int:
    sparcoll.keep_freed_memory()    # as sparcoll train's workers: the backward timeline is theirs
    return run_worker(argv, profile_job)


if __name__ == "__main__":
    exit_process(main())
