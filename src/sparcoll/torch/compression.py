"""DDP communication hook that compresses gradients with sparcoll.compress, parameter by parameter.

    state = sparcoll.torch.CompressionState(sparcoll.init(), "powersgd:4")   # or a gloo group
    ddp.register_comm_hook(state, sparcoll.torch.compression_hook)

Each bucket is cut back into its parameters' gradients, and each gets its parameter's spec: the
state's spec, except 1-D parameters (biases, norms), which go uncompressed unless compress_1d=True,
and whatever `per_param` says (a {parameter: spec} mapping, or a function of the parameter returning
a spec or None for the default). Uncompressed gradients of a bucket are averaged in one allreduce;
each compressed one by its compressor's collective, with its own error feedback and warm start (keyed
by the parameter, so DDP's rebuilt buckets after the first step keep them). Any bucket layout works:
every rank runs the same collectives in the same order, in the hook, before it returns.

Gradients are averaged, as DDP's. Under `no_sync` DDP calls no hook and gradients accumulate; the
next synchronized step compresses the accumulated gradients, so accumulation works unchanged.
"""
# No `from __future__ import annotations`: DDP checks the hook's annotations against the real types.
from typing import Callable, Mapping, Union

import torch
import torch.distributed as dist

from sparcoll.communicator import Communicator
from sparcoll.compress import Reducer, Spec, parse
from sparcoll.compress.channel import Channel

from .backend import _backend_of
from .futures import Completion

_NONE = parse("none")


class CompressionState:
    """comm_or_group: a sparcoll Communicator (blocktopk's sparse AllReduce; every other collective
    on `group`, default the whole job), a torch ProcessGroup (gloo, or "sparcoll", whose
    communicator then serves blocktopk), or None (the whole job's default group)."""

    def __init__(self, comm_or_group=None, spec: Union[str, Spec] = "none", *,
                 per_param: Union[Mapping, Callable, None] = None, compress_1d: bool = False,
                 group=None):
        if isinstance(comm_or_group, Communicator):
            comm = comm_or_group
        else:
            group = comm_or_group if comm_or_group is not None else group
            backend = _backend_of(group or dist.distributed_c10d._get_default_group())
            comm = backend.comm if backend is not None else None
        self.comm, self.group = comm, group
        self.spec = parse(spec)
        self.compress_1d = compress_1d
        if isinstance(per_param, Mapping):
            self._overrides = {id(p): parse(s) for p, s in per_param.items()}
            self._rule = None
        else:
            self._overrides, self._rule = {}, per_param
        self._reducers: dict = {}
        self.channel = Channel(group, comm)

    def spec_for(self, param: torch.Tensor) -> Spec:
        if id(param) in self._overrides:
            return self._overrides[id(param)]
        chosen = self._rule(param) if self._rule is not None else None
        if chosen is not None:
            return parse(chosen)
        return self.spec if param.dim() > 1 or self.compress_1d else _NONE

    def reducer(self, spec: Spec) -> Reducer:
        key = str(spec)
        if key not in self._reducers:
            self._reducers[key] = Reducer(spec, self.group, self.comm)
        return self._reducers[key]

    def reduce_bucket(self, bucket) -> torch.Tensor:
        """Average the bucket's gradients over ranks; the result (the buffer, or a new sparse
        tensor for a sparse gradient)."""
        buffer, params = bucket.buffer(), bucket.parameters()
        if buffer.is_sparse:
            result = self.reducer(self.spec_for(params[0])).reduce(buffer, key=params[0])
            return result if result.is_sparse else result.to_sparse(buffer.sparse_dim())
        plain, compressed, offset = [], [], 0
        for param in params:
            view = buffer[offset:offset + param.numel()]
            offset += param.numel()
            spec = self.spec_for(param)
            if spec == _NONE:
                plain.append(view)
            else:
                compressed.append((param, view, spec))
        self._average(buffer, plain)
        for param, view, spec in compressed:
            view.copy_(self.reducer(spec).reduce(view.view(param.shape), key=param).reshape(-1))
        return buffer

    def _average(self, buffer: torch.Tensor, views: list) -> None:
        """One allreduce for every uncompressed gradient; the whole buffer in place when that is all
        of it (then bit for bit what DDP computes)."""
        if sum(v.numel() for v in views) == buffer.numel():
            self.channel.allreduce_mean(buffer)
        elif views:
            flat = self.channel.allreduce_mean(torch.cat(views))
            for view, part in zip(views, flat.split([v.numel() for v in views])):
                view.copy_(part)


def compression_hook(state: CompressionState,
                     bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Compress and average `bucket`'s gradients (see CompressionState); a failure fails the future,
    and DDP's backward raises it."""
    try:
        value, error = state.reduce_bucket(bucket), None
    except Exception as exc:
        value, error = bucket.buffer(), exc
    return Completion(value, error=error).future
