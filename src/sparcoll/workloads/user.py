"""A user's own model as a workload: what `sparcoll plan --model MODULE:FUNCTION` profiles and its trial
trains.

FUNCTION() returns ``(model, batch)``: an ``nn.Module`` and an example input of one worker (a tensor, a
tuple of tensors, the model's positional arguments, or a dict or other mapping of tensors, its keyword
arguments, as a tokenizer gives them). Every step trains on that same input. The loss is the model's output
itself when it is a scalar tensor; else a scalar "loss" of a dict it returns (as Hugging Face models do when
given labels); else the sum of every floating-point tensor it returns, in a tensor, tuple, list or dict,
nested or not. That is enough to time a step (what the planner needs), not to learn anything. `sparcoll
plan` calls FUNCTION first in its own process (checked_here, fingerprint), then each worker calls it itself
(the module must be importable where the workers start: the current directory or PYTHONPATH); DataParallel
and DDP broadcast rank 0's parameters, so a FUNCTION that does not seed its model still trains one model.
The planner prices float32 gradients (4 bytes an element, as its collectives were timed): a model with a
trainable parameter of another dtype is refused, naming it.
"""
from __future__ import annotations

import hashlib
import importlib
import itertools
import json
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from sparcoll.torch.parallel import tensors_in
from sparcoll.torch.sparse import sparse_weights

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
        self.keywords = isinstance(batch, Mapping)     # then self.batch is (the mapping,)
        self.batch: Batch = batch if isinstance(batch, tuple) else (batch,)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        out = model(**batch[0]) if self.keywords else model(*batch)
        if isinstance(out, torch.Tensor) and out.dim() == 0:
            return out
        if isinstance(out, Mapping) and isinstance(out.get("loss"), torch.Tensor) and out["loss"].dim() == 0:
            return out["loss"]
        summed = [t.sum() for t in tensors_in(out) if t.is_floating_point()]
        if not summed:
            raise ValueError(f"--model {self.config.spec!r}: the model must return a scalar loss, or tensors whose "
                             f"sum is the loss (in a tuple, list or dict), got {_kinds(out)} with no "
                             f"floating-point tensor")
        return torch.stack(summed).sum()

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
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and not (module_name + ".").startswith(exc.name + "."):
            raise ValueError(f"--model {spec!r}: importing {module_name} failed: {exc}") from None   # its import
        raise ValueError(f"--model {spec!r}: cannot import {module_name} ({exc}); the module must be importable "
                         f"from the current directory or PYTHONPATH") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"--model {spec!r}: {module_name} has no function {function_name}")
    built = function()
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module)):
        raise ValueError(f"--model {spec!r}: {function_name}() must return (nn.Module, example input), "
                         f"got {type(built).__name__}")
    example = built[1]
    tensors = (example if isinstance(example, tuple) else example.values() if isinstance(example, Mapping)
               else (example,))
    if not all(isinstance(x, torch.Tensor) for x in tensors) \
            or isinstance(example, Mapping) and not all(isinstance(k, str) for k in example):
        raise ValueError(f"--model {spec!r}: the example input must be a tensor, a tuple of tensors (the model's "
                         f"positional arguments) or a dict of tensors by name (its keyword arguments), got "
                         f"{_kinds(example)}")
    other = [(name, p.dtype) for name, p in built[0].named_parameters() if p.requires_grad and p.dtype != torch.float32]
    if other:
        name, dtype = other[0]
        raise ValueError(f"--model {spec!r}: parameter {name} is {dtype} ({len(other)} not float32): the planner's "
                         f"cost models price float32 gradients, 4 bytes an element; build the model in float32")
    return built


def _kinds(value) -> str:
    """The type of an example input or an output, and of each item of a tuple, list or dict."""
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {', '.join(type(x).__name__ for x in value)}"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} of {', '.join(f'{k}: {type(x).__name__}' for k, x in value.items())}"
    return type(value).__name__



def checked_here(spec: str) -> UserModel:
    """The model built in `sparcoll plan`'s own process as each worker builds it, before any starts: a
    model the workers would refuse (build, loss) is refused once, with its reason, not in a traceback
    of every worker. The module is imported as the workers' `python -m` imports it, from the current
    directory too. One forward checks what the model returns, and that its loss depends on a parameter
    to train (not so for an output detached or of argmax, or a model without parameters: every
    worker's backward would fail). An error of the user's code, of any type, is a ValueError naming
    the spec."""
    here = os.getcwd()
    added = here not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        workload = UserModel(spec)
        loss = workload.loss(workload.model, workload.batch)
    except Exception as exc:
        if isinstance(exc, ValueError) and str(exc).startswith(f"--model {spec!r}"):
            raise
        raise ValueError(f"--model {spec!r} failed: {type(exc).__name__}: {exc}") from None
    finally:
        if added:
            sys.path.remove(here)
    if not any(p.requires_grad for p in workload.model.parameters()):
        raise ValueError(f"--model {spec!r}: the model has no parameter to train (requires_grad): nothing to plan")
    if not loss.requires_grad:
        raise ValueError(f"--model {spec!r}: the loss does not depend on any parameter to train (an output "
                         f"detached, or of argmax?): backward would have no gradient to synchronize")
    return workload


def fingerprint(workload: UserModel) -> str:
    """What a profile of the model holds for (no forward): its parameters' names, shapes, dtypes,
    requires_grad and whether their gradients are sparse COO (an embedding's sparse=True: another
    collective's costs), and its example input's shapes and dtypes, hashed. A model edited under the
    same MODULE:FUNCTION is another model. A model without sparse gradients keeps the fingerprint it
    had before they counted, and so its stored profile."""
    sparse = sparse_weights(workload.model)
    described = [[name, list(p.shape), str(p.dtype), p.requires_grad, *(["sparse"] if id(p) in sparse else [])]
                 for name, p in workload.model.named_parameters()]
    if workload.keywords:
        described.append([[name, list(x.shape), str(x.dtype)] for name, x in sorted(workload.batch[0].items())])
    else:
        described.append([[list(x.shape), str(x.dtype)] for x in workload.batch])
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()[:16]
