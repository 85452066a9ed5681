"""The planner's view of a model: what each gradient is (`facts`), and when backward produces it
(`backward_timeline`: each parameter's ready time over a few uncompressed iterations, from autograd's
post-accumulate hooks, as ByteComp traces its models).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from sparcoll.torch.sfb import eligible_layers

from .options import TensorFacts
from .timeline import Step


def facts(model: nn.Module) -> list[TensorFacts]:
    """Each trainable parameter's facts, in model.named_parameters() order: linear layers' weights
    that SFB can serve (sparcoll.torch.sfb.eligible_layers) and sparse embeddings' COO gradients."""
    linear = {id(layer.weight) for layer in eligible_layers(model)}
    coo = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}
    return [TensorFacts(name, p.numel(), linear=id(p) in linear, coo=id(p) in coo)
            for name, p in model.named_parameters() if p.requires_grad]


@dataclass(frozen=True)
class BackwardProfile:
    """A model's measured backward: parameter names in the order their gradients became ready, and
    the Step the simulator takes (ready times from backward's start, its end, the optimizer step),
    medians over the measured iterations; the forward time is kept for reports. `output_gradient`:
    for each weight of a layer SFB can serve, when its layer's output gradient arrived (SFB's
    factors are ready then, before the layer's backward runs)."""
    order: tuple[str, ...]
    step: Step
    forward: float
    output_gradient: dict[str, float]


def backward_timeline(model: nn.Module, loss_of: Callable[[nn.Module], torch.Tensor],
                      iterations: int = 5, warmup: int = 1) -> BackwardProfile:
    """Time `iterations` (after `warmup`) steps of the model alone, uncompressed: loss_of(model)
    builds the loss, backward and a plain SGD step follow. The parameters are restored afterwards."""
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    seen: list[tuple[str, float]] = []
    outputs: list[tuple[str, float]] = []
    handles = [p.register_post_accumulate_grad_hook(lambda p: seen.append((names[id(p)], time.perf_counter())))
               for p in params]

    def watch_output(layer: nn.Linear, args, output: torch.Tensor) -> None:
        if output.requires_grad:
            name = names[id(layer.weight)]
            output.register_hook(lambda grad: outputs.append((name, time.perf_counter())))
    handles += [layer.register_forward_hook(watch_output) for layer in eligible_layers(model)
                if id(layer.weight) in names]
    optimizer = torch.optim.SGD(params, lr=1e-3)
    runs = []
    try:
        for i in range(warmup + iterations):
            optimizer.zero_grad()
            seen.clear()
            outputs.clear()
            start = time.perf_counter()
            loss = loss_of(model)
            forward_end = time.perf_counter()
            loss.backward()
            backward_end = time.perf_counter()
            optimizer.step()
            done = time.perf_counter()
            if i >= warmup:
                runs.append((dict((n, t - forward_end) for n, t in seen), [n for n, _ in seen],
                             backward_end - forward_end, done - backward_end, forward_end - start,
                             {n: t - forward_end for n, t in reversed(outputs)}))    # a layer's first to arrive
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for p, value in zip(params, saved):
                p.copy_(value)
        optimizer.zero_grad()
    order = runs[-1][1]
    if any(r[1] != order for r in runs):
        raise RuntimeError("the model's gradients became ready in different orders across iterations")
    ready = tuple(statistics.median(r[0][n] for r in runs) for n in order)
    return BackwardProfile(tuple(order), Step(ready, statistics.median(r[2] for r in runs),
                                       statistics.median(r[3] for r in runs)),
                           statistics.median(r[4] for r in runs),
                           {n: statistics.median(r[5][n] for r in runs if n in r[5])
                            for n in set().union(*(r[5] for r in runs))})
