"""The planner's view of a model: what each gradient is (`facts`), and when backward produces it
(`backward_timeline`: each parameter's ready time over a few uncompressed iterations, from autograd's
post-accumulate hooks, as ByteComp traces its models).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from sparcoll.bench.memory import minor_faults
from sparcoll.torch.sfb import eligible_layers
from sparcoll.torch.sparse import sparse_weights

from .options import TensorFacts
from .timeline import Step

PAGE = 4096
SETTLED_PAGES = 256     # an iteration that touches fewer new pages than this (or 1% of the parameters' bytes)
MOST_WARMUP = 8         # ... ends the warm-up, which runs at most this many iterations


def facts(model: nn.Module) -> list[TensorFacts]:
    """Each trainable parameter's facts, in model.named_parameters() order: linear layers' weights
    that SFB can serve (sparcoll.torch.sfb.eligible_layers) and sparse embeddings' COO gradients."""
    linear = {id(layer.weight) for layer in eligible_layers(model)}
    coo = sparse_weights(model)
    return [TensorFacts(name, p.numel(), linear=id(p) in linear, coo=id(p) in coo)
            for name, p in model.named_parameters() if p.requires_grad]


@dataclass(frozen=True)
class BackwardProfile:
    """A model's measured backward: parameter names in the order their gradients became ready, and
    the Step the simulator takes (ready times from backward's start, its end, the optimizer step),
    means over the measured iterations; the forward time is kept for reports. `output_gradient`:
    for each weight of a layer SFB can serve, when its layer's output gradient arrived (SFB's
    factors are ready then, before the layer's backward runs)."""
    order: tuple[str, ...]
    step: Step
    forward: float
    output_gradient: dict[str, float]


class Alone:
    """Iterations of one process on its own: each timed from its own start."""

    def start(self) -> None:
        """Called before each iteration (profiler.Together: a barrier)."""

    def most(self, seconds: float) -> float:
        """The first iteration's length as every worker counts it (Together: the slowest's)."""
        return seconds

    def slowest(self, times: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """Per iteration (row), the time each point (column) was reached from the iteration's start."""
        return times


def backward_timeline(model: nn.Module, loss_of: Callable[[nn.Module], torch.Tensor], iterations: int = 5,
                      warmup: int = 1, seconds: float = 1.0, most: int = 200, peers=Alone(),
                      skipped: frozenset = frozenset()) -> BackwardProfile:
    """Time steps of the model, uncompressed: loss_of(model) builds the loss, backward and a plain SGD
    step follow; at least `iterations` after `warmup`, as many as fit in `seconds` by the warm-up's
    length (at most `most`). `peers` starts every iteration on every worker together and takes, per
    iteration, the time the slowest worker reached each point (profiler.Together): a training step
    starts on every worker at once, and with more workers than cores a step of a few ms either runs
    whole or waits for a time slice, so each worker's own times (the median of five: ncf's backward
    ended at 2.1 ms in one profile, 9.3 in another) said little. The step's learning rate is 0: it
    costs what any plain SGD step costs and leaves the parameters as they were, with no copy of them
    to restore (vgg's 800 MB, with every worker on one host). The warm-up lasts until an iteration
    touches almost no new memory (SETTLED_PAGES, at most MOST_WARMUP iterations), as the allocator
    of a training step some steps in: after one warm-up iteration, vgg's first timeline faulted
    1458-1470 MiB of pages in and read its backward at 1.22-1.43 s (its first hidden layer's part
    0.73-0.90 s; profiles had read 0.35-1.11 s for it), after settling 0.92-0.98 s (0.41-0.48), and
    timelines after it 0.71-1.03 s (4 workers, one probe each). `skipped`: names of layers' weights
    whose gradient backward does not compute (requires_grad off throughout, as under SFB): what
    computing them costs is the difference from a timeline without (`spared_in_backward`)."""
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    watched = [layer for layer in eligible_layers(model) if id(layer.weight) in names]
    turned_off = [p for p in model.parameters() if names.get(id(p)) in skipped]
    for p in turned_off:
        p.requires_grad_(False)
    try:
        return _timeline(model, loss_of, iterations, warmup, seconds, most, peers, names, watched)
    finally:
        for p in turned_off:
            p.requires_grad_(True)


def runs_that_fit(seconds: float, each: float, least: int, most: int) -> int:
    """How many runs of `each` seconds fit in `seconds`, at least `least` and at most `most`."""
    return min(most, max(least, int(seconds / max(each, 1e-6))))


def _timeline(model, loss_of, iterations, warmup, seconds, most, peers, names, watched) -> BackwardProfile:
    """backward_timeline's iterations, with the weights it skips already turned off."""
    params = [p for p in model.parameters() if p.requires_grad]
    seen: list[tuple[str, float]] = []
    outputs: list[tuple[str, float]] = []
    handles = [p.register_post_accumulate_grad_hook(lambda p: seen.append((names[id(p)], time.perf_counter())))
               for p in params]

    def watch_output(layer: nn.Linear, args, output: torch.Tensor) -> None:
        if output.requires_grad:
            name = names[id(layer.weight)]
            output.register_hook(lambda grad: outputs.append((name, time.perf_counter())))
    handles += [layer.register_forward_hook(watch_output) for layer in watched]
    optimizer = torch.optim.SGD(params, lr=0.0)
    settled = max(SETTLED_PAGES, sum(p.numel() * p.element_size() for p in params) // (100 * PAGE))
    rows, starts, orders = [], [], []
    try:
        warmed, count = 0, None
        while count is None or len(rows) < count:
            optimizer.zero_grad()
            seen.clear()
            outputs.clear()
            peers.start()
            faults = minor_faults()
            start = time.perf_counter()
            loss = loss_of(model)
            forward_end = time.perf_counter()
            loss.backward()
            backward_end = time.perf_counter()
            optimizer.step()
            done = time.perf_counter()
            if count is None:       # warming up (every worker decides alike: peers.most is everyone's most)
                warmed += 1
                new_pages = peers.most(float(minor_faults() - faults))
                if warmed >= warmup and (new_pages <= settled or warmed >= MOST_WARMUP):
                    # the last warm-up's length says how many iterations fit
                    count = runs_that_fit(seconds, peers.most(done - start), iterations, most)
                continue
            arrived = dict(reversed(outputs))       # a layer's first output gradient to arrive
            rows.append([t - start for t in (forward_end, *(t for _, t in seen), backward_end, done,
                         *(arrived.get(names[id(layer.weight)], float("nan")) for layer in watched))])
            starts.append(start)
            orders.append([n for n, _ in seen])
    finally:
        for handle in handles:
            handle.remove()
        optimizer.zero_grad()
    order = orders[-1]
    if any(o != order for o in orders):
        raise RuntimeError("the model's gradients became ready in different orders across iterations")
    times = peers.slowest(torch.tensor(rows, dtype=torch.float64), torch.tensor(starts, dtype=torch.float64))
    n = len(order)
    forward = times[:, 0]
    mean = lambda column: column.nanmean().item()      # noqa: E731 (a layer never called: no time)
    return BackwardProfile(tuple(order),
                           Step(tuple(mean(times[:, 1 + i] - forward) for i in range(n)),
                                mean(times[:, n + 1] - forward), mean(times[:, n + 2] - times[:, n + 1])),
                           mean(forward),
                           {names[id(layer.weight)]: mean(times[:, n + 3 + j] - forward)
                            for j, layer in enumerate(watched)
                            if not torch.isnan(times[:, n + 3 + j]).all()})
