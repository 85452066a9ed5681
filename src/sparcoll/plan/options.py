"""The options per tensor, as ByteComp's decision tree: whether and how to compress (a
sparcoll.compress spec), the collective that carries the result, and where compression runs (on the
training thread, or offloaded to a worker thread: ByteComp's GPU/CPU choice on machines without a
GPU). Every level and every rule is data: add a compressor to ALL_COMPRESSORS, a collective to
COLLECTIVES, a rule to RULES.

A rule says which combinations are invalid and why; `options(tensor, job)` is the product of the
levels with every invalid combination pruned, and `why_invalid` names the rule an option breaks.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Callable

from sparcoll.compress import make

RING, SPARSE, DEDICATED, ALLGATHER, PS, SFB = "ring", "sparse", "sparse-dedicated", "allgather", "ps", "sfb"
COLLECTIVES = (RING, SPARSE, DEDICATED, ALLGATHER, PS, SFB)
# One parameter per compressor family, the ones the compression figures found worth running.
ALL_COMPRESSORS = ("none", "fp16", "bf16", "randomk:0.01", "topk:0.01", "dgc:0.01", "qsgd:16", "terngrad",
                   "efsignsgd", "onebit", "powersgd:4", "blocktopk:0.01")
# The planner chooses by speed, so its default candidates are the compressors that kept the loss within
# 5% of DDP's on both of the convergence runs of docs/benchmarks-log.md (gpt and vgg, tiny, 200 steps): the
# others fell 11-71% behind on vgg (terngrad, top-k, DGC, random-k; random-k 25% on gpt too), and
# speed alone picked random-k for gpt (+4.6% held-out loss after 20 steps) and terngrad for deeplight.
HURT_CONVERGENCE = ("randomk:0.01", "topk:0.01", "dgc:0.01", "terngrad")
COMPRESSORS = tuple(c for c in ALL_COMPRESSORS if c not in HURT_CONVERGENCE)


@dataclass(frozen=True)
class Option:
    compressor: str = "none"      # a sparcoll.compress spec; "none": the gradient as it is
    collective: str = RING
    offload: bool = False          # compression on a worker thread instead of the training thread

    @property
    def uncompressed_sparse(self) -> bool:
        """The gradient as it is, under the sparse AllReduce (colocated or dedicated)."""
        return self.compressor == "none" and self.collective in (SPARSE, DEDICATED)

    def __str__(self) -> str:
        where = ", offloaded" if self.offload else ""
        return self.collective if self.compressor == "none" else f"{self.compressor} by {self.collective}{where}"


@dataclass(frozen=True)
class TensorFacts:
    """What the rules need to know of a gradient."""
    name: str
    numel: int
    linear: bool = False          # the weight of an nn.Linear (SFB applies)
    coo: bool = False             # a sparse COO gradient (nn.Embedding(sparse=True))


@dataclass(frozen=True)
class JobFacts:
    dedicated: bool = False       # the job has dedicated aggregators
    communicator: bool = True     # a sparcoll Communicator is there (the sparse AllReduce)
    offload_core: bool = True     # each worker has a core besides its training thread's


# The collective that carries each compressor scheme's payload (sparcoll.compress's `scheme`).
CARRIERS = {"allreduce": (RING,), "powersgd": (RING,), "sparse": (SPARSE, DEDICATED), "allgather": (ALLGATHER,)}


@functools.lru_cache(maxsize=None)
def scheme(compressor: str) -> str | None:
    """How a compressor's payload travels; None for an uncompressed gradient. Cached: the rules ask
    for every option of every tensor."""
    return None if compressor == "none" else make(compressor).scheme


@functools.lru_cache(maxsize=None)
def compresses_entries(compressor: str) -> bool:
    """Whether the compressor takes a sparse COO gradient's entries without densifying it."""
    return make(compressor).entries


@dataclass(frozen=True)
class Rule:
    reason: str
    invalid: Callable[[TensorFacts, JobFacts, Option], bool]


RULES = (
    Rule("SFB applies to linear layers' weights only",
         lambda t, j, o: o.collective == SFB and not t.linear),
    Rule("SFB and the parameter server carry uncompressed gradients",
         lambda t, j, o: o.collective in (SFB, PS) and o.compressor != "none"),
    Rule("a compressed payload travels by the collective that fits it: summable ones by an "
         "allreduce, blocktopk's block-sparse one by the sparse AllReduce, the rest gathered",
         lambda t, j, o: o.compressor != "none" and o.collective not in CARRIERS[scheme(o.compressor)]),
    Rule("an uncompressed gradient is summed, never gathered",
         lambda t, j, o: o.compressor == "none" and o.collective == ALLGATHER),
    Rule("nothing to offload without compression",
         lambda t, j, o: o.offload and o.compressor == "none"),
    Rule("offloading needs a core the training thread does not use (else it only takes the training "
         "thread's time)",
         lambda t, j, o: o.offload and not j.offload_core),
    Rule("a sparse COO gradient is compressed with its collective, on the channel: nothing to offload",
         lambda t, j, o: o.offload and t.coo),
    Rule("PowerSGD computes between its two allreduces, on the channel: nothing to offload",
         lambda t, j, o: o.offload and scheme(o.compressor) == "powersgd"),
    Rule("the sparse AllReduce needs a sparcoll Communicator",
         lambda t, j, o: o.collective in (SPARSE, DEDICATED) and not j.communicator),
    Rule("dedicated aggregators only in a job that has them",
         lambda t, j, o: o.collective == DEDICATED and not j.dedicated),
    Rule("a sparse COO gradient is never densified: no parameter server, and only compressors of "
         "its entries",
         lambda t, j, o: t.coo and (o.collective == PS or (o.compressor != "none"
                                                            and not compresses_entries(o.compressor)))),
)


def coo_label(option: Option) -> str:
    """The name a sparse COO gradient's option is measured under in a profile (profiler.profile_coo):
    its compressor's spec, or for an uncompressed one its collective (the sparse AllReduce's, with
    or without dedicated aggregators: the communicator's)."""
    if option.compressor != "none":
        return option.compressor
    return SPARSE if option.collective == DEDICATED else option.collective


def coo_labels(compressors) -> list[str]:
    """Every option a sparse COO gradient can take, by coo_label: the group's sparse all_reduce
    (gloo's gathers), sparcoll's sparse AllReduce, and each compressor of its entries."""
    return [RING, SPARSE] + [c for c in compressors if c != "none" and compresses_entries(c)]


def why_invalid(tensor: TensorFacts, job: JobFacts, option: Option) -> str | None:
    """The reason of the first rule `option` breaks for `tensor` in `job`, or None if it is valid."""
    return next((rule.reason for rule in RULES if rule.invalid(tensor, job, option)), None)


def options(tensor: TensorFacts, job: JobFacts, compressors=COMPRESSORS, collectives=COLLECTIVES) -> list[Option]:
    """Every valid option for `tensor`: the tree's product with the invalid branches pruned."""
    tree = itertools.product(compressors, collectives, (False, True))
    return [o for o in (Option(*branch) for branch in tree) if why_invalid(tensor, job, o) is None]
