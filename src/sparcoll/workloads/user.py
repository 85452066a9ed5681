"""A user's own model as a workload: what `sparcoll plan --model MODULE:FUNCTION` profiles and its trial
trains.

FUNCTION() returns ``(model, batch)``: an ``nn.Module`` and an example input of one worker (a tensor, or
a tuple of the model's positional arguments). Every step trains on that same input; the loss is the
output itself when the model returns a scalar, else the output's sum. That is enough to time a step
(what the planner needs), not to learn anything. Each worker calls FUNCTION itself (the module must be
importable where the workers start: the current directory or PYTHONPATH); DataParallel and DDP
broadcast rank 0's parameters, so a FUNCTION that does not seed its model still trains one model.
The planner prices float32 gradients (4 bytes an element, as its collectives were timed): a model with
a trainable parameter of another dtype is refused, naming it.
"""
from __future__ import annotations

import importlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .base import Batch, Workload


@dataclass(frozen=True)
class Config:
    spec: str
    sparse_embeddings: bool = False


class UserModel(Workload):
    name = "user"

    def __init__(self, spec: str):
        model, batch = build(spec)
        super().__init__(model, Config(spec), ())
        self.batch: Batch = batch if isinstance(batch, tuple) else (batch,)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        out = model(*batch)
        return out if out.dim() == 0 else out.sum()

    def batches(self, batch_size: int = 0, rank: int = 0, world_size: int = 1, seed: int = 0,
                start_step: int = 0) -> Iterator[Batch]:
        """The example input, every step (the function gave one worker's; sizes are its own)."""
        return itertools.repeat(self.batch)


def split(spec: str) -> tuple[str, str]:
    """MODULE and FUNCTION of a spec (checked before any worker starts)."""
    module_name, sep, function_name = spec.partition(":")
    if not sep or not module_name or not function_name:
        raise ValueError(f"--model {spec!r}: expected MODULE:FUNCTION, e.g. mypackage.models:build")
    return module_name, function_name


def build(spec: str) -> tuple[nn.Module, object]:
    """Import MODULE and call FUNCTION, with errors that say which part of the spec failed."""
    module_name, function_name = split(spec)
    function = getattr(importlib.import_module(module_name), function_name, None)
    if not callable(function):
        raise ValueError(f"--model {spec!r}: {module_name} has no function {function_name}")
    built = function()
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module)):
        raise ValueError(f"--model {spec!r}: {function_name}() must return (nn.Module, example input), "
                         f"got {type(built).__name__}")
    other = [(name, p.dtype) for name, p in built[0].named_parameters() if p.requires_grad and p.dtype != torch.float32]
    if other:
        name, dtype = other[0]
        raise ValueError(f"--model {spec!r}: parameter {name} is {dtype} ({len(other)} not float32): the planner's "
                         f"cost models price float32 gradients, 4 bytes an element; build the model in float32")
    return built
