"""Gradient compression: every standard compressor, with error feedback, each communicated by the
cheapest collective its payload allows.

    import sparcoll.compress as sc
    c = sc.make("topk:0.01")              # a Compressor: compress / decompress / payload_bytes
    r = sc.Reducer("topk:0.01", group)    # compress + communicate + decompress + error feedback
    avg = r.reduce(grad, key="fc.weight") # the AVERAGE over the group's ranks

Specs (spec.py): none, fp16, bf16, topk:RATIO, randomk:RATIO, threshold:VALUE, dgc:RATIO,
qsgd:LEVELS, terngrad, signsgd, efsignsgd, onebit, powersgd:RANK, blocktopk:RATIO; options after
a comma or colon: ef=on|off (error feedback; on by default for topk, randomk, threshold, dgc,
efsignsgd, onebit, powersgd, blocktopk), seed=INT (randomk, powersgd), momentum=FLOAT (dgc, default
0.9: run the optimizer without momentum). Reducer.reduce_many reduces several tensors in one
collective.

| compressor | collective | error feedback |
|---|---|---|
| none, fp16, bf16 | allreduce of the (cast) tensor | off |
| randomk | allreduce of k values (indices from a seed shared by all ranks) | on |
| powersgd | two allreduces (P, Q); Q warm-started, identical on every rank; a tensor its factors would not shrink (n x 1, 3 x 3) averaged as it is | on |
| blocktopk | sparcoll's sparse AllReduce of the kept blocks | on |
| topk, threshold, dgc | allgather of (int32 indices, values), variable size | on (dgc: momentum correction) |
| qsgd, terngrad | allgather of quantized values + scale | off (unbiased) |
| signsgd, efsignsgd, onebit | allgather of packed sign bits + 2 values | signsgd off, others on |

Sparse COO input (e.g. nn.Embedding(sparse=True) gradients) is compressed entry by entry without
densifying by none, fp16, bf16, topk, threshold and blocktopk, and stays COO; the others densify it
first. Its kept entries go by sparcoll's sparse AllReduce when a communicator is given, for blocktopk
and none/fp16/bf16 (fp16/bf16 values stay cast on the wire), and by the group's own sparse all_reduce
for blocktopk without one (gloo's gathers); otherwise they are gathered.
"""
from __future__ import annotations

from .base import Compressor, Payload
from .reducer import Reducer
from .registry import CLASSES, make
from .spec import KINDS, Spec, parse, usage

__all__ = ["make", "parse", "usage", "Spec", "Reducer", "Compressor", "Payload", "KINDS", "CLASSES"]
