"""Sufficient-factor broadcasting (Poseidon) for nn.Linear: y = x W^T + b has the weight gradient
u^T v, u = dL/dy (K x M) and v = x (K x N), K the rows of the batch (batch x tokens for inputs with
extra leading dimensions), and the bias gradient the column sums of u. Every rank gathers every rank's
(u, v) and rebuilds the exact sum: W's gradient U^T V with U, V the ranks' factors stacked (one
matmul), b's the column sums of U. Lossless: the gradient equals an allreduce's up to float summation
order. Ranks may hold different K (the gather is variable-size).

The local weight gradient is never needed, so autograd does not compute it: the wrapper turns the
weight's requires_grad off for the layer's call (when the output still needs a gradient through
the input or the bias) and starts SFB from the output's gradient hook. Each call of the layer is
rebuilt on its own and summed into the gradient, so a call whose graph never reaches backward (an
evaluation forward outside torch.no_grad) leaves nothing behind; every rank must call the layer as
often in a step (each gather is labelled with its call, and end_of_step closes the step's gathers:
MismatchError on every rank otherwise).
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from sparcoll.compress.channel import Channel


def eligible_layers(model: nn.Module) -> list[nn.Linear]:
    """The model's nn.Linear layers SFB can serve: a trainable weight of its own, which no other
    module owns too (a tied embedding and softmax get gradient from both; the factors cover only the
    layer's part), and which is the parameter itself (a weight computed from others, as
    weight_norm's or a parametrization's, passes its gradient on to them). A subclass that computes
    its output another way than x W^T + b (a scaled weight, a LoRA adapter) has other factors."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    return [m for m in model.modules()
            if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward and m.weight.requires_grad
            and owners.get(id(m.weight)) == 1]


class Call:
    """One call of the layer in a step: its input (v), until its output's gradient (u) arrives. Only
    the autograd graph holds it, so it vanishes with a graph that never gets a backward. `version`:
    the input's version counter at the call, as autograd keeps it for a tensor it saved (SFB reads
    the input itself at backward, which an in-place change since would falsify)."""

    def __init__(self, inputs: torch.Tensor | None):
        self.inputs = inputs
        self.version = None if inputs is None else inputs._version


class LinearState:
    """One nn.Linear's synchronization in the current step: the strategy chosen at its first call
    (from that call's rows), the live calls, and the averaged gradients being summed."""

    def __init__(self, layer: nn.Linear, name: str):
        self.layer, self.name = layer, name
        self.skipping = False      # the weight's requires_grad is off during the current call
        self.result: torch.Tensor | None = None    # storage for the weight gradient, kept across steps
        self.reset()

    def reset(self) -> None:
        """A new step: the bias takes part if it is trainable now (it may have been frozen since)."""
        bias = self.layer.bias
        self.bias = bias if bias is not None and bias.requires_grad else None
        self.strategy: str | None = None
        self.rows = 0
        self.calls: weakref.WeakSet = weakref.WeakSet()
        self.gathers = 0                   # the calls whose factors were queued this step
        self.local_grad = False            # some call left requires_grad on: autograd adds to .grad
        self.started = False               # the first factors of the step have been queued
        self.base: tuple = (None, None)    # the gradients the step's averages add to
        self.weight_sum: torch.Tensor | None = None
        self.bias_sum: torch.Tensor | None = None

    def start(self) -> None:
        """At the step's first output gradient, before autograd accumulates anything of this
        backward into the layer: keep the gradients the averages add to, as DDP's would."""
        self.started = True
        weight, bias = self.layer.weight.grad, self.bias
        if weight is not None and self.local_grad:
            weight = weight.clone()        # autograd will add the local gradient to .grad
        bias = bias.grad.clone() if bias is not None and bias.grad is not None else None
        self.base = (weight, bias)

    def add(self, big_u: torch.Tensor, big_v: torch.Tensor) -> None:
        """Add one call's rebuilt average (U^T V with U already divided by the world) to the
        step's sums, the first onto start()'s gradients. One matmul written in place: no M x N
        temporary, no copy."""
        if self.weight_sum is None:
            before, bias_before = self.base
            if before is not None:
                self.weight_sum = before.addmm_(big_u.t(), big_v)
            else:
                if self.result is None:
                    self.result = torch.empty_like(self.layer.weight)
                self.weight_sum = torch.mm(big_u.t(), big_v, out=self.result)
            if self.bias is not None:
                column = big_u.sum(0)
                self.bias_sum = column if bias_before is None else bias_before.add_(column)
        else:
            self.weight_sum.addmm_(big_u.t(), big_v)
            if self.bias is not None:
                self.bias_sum.add_(big_u.sum(0))


def gather_factors(u: torch.Tensor, v: torch.Tensor, channel: Channel,
                   label: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's factors stacked, (U / P, V): one variable-size allgather of (u, v), labelled (the
    layer's tag, which of its calls in the step this is) on a channel of SFB's own, so that ranks
    that called a layer a different number of times raise LabelMismatch instead of pairing one
    call's factors with another's (end_of_step)."""
    m, n = u.shape[1], v.shape[1]
    gathered = channel.allgather((u.reshape(-1), v.reshape(-1)), variable=True, label=label)
    big_u = torch.cat([parts[0].view(-1, m) for parts in gathered]).div_(channel.world)
    big_v = torch.cat([parts[1].view(-1, n) for parts in gathered])
    return big_u, big_v


END = 0     # the label's tag of end_of_step (a layer's tag is at least 1)


def end_of_step(channel: Channel, gathers: int) -> None:
    """After a step's last gather_factors, the same size exchange labelled (END, the step's gathers):
    a rank with more calls of some layer than a peer meets this instead of a gather, and both raise
    LabelMismatch; so do ranks whose counts per layer differ, at their first gather that does."""
    empty = torch.empty(0)
    channel.allgather((empty, empty), variable=True, label=(END, gathers))
