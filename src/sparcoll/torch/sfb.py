"""Sufficient-factor broadcasting (Poseidon) for nn.Linear: y = x W^T + b has the weight gradient
u^T v, u = dL/dy (K x M) and v = x (K x N), K the rows of the batch (batch x tokens for inputs with
extra leading dimensions), and the bias gradient the column sums of u. Every rank gathers every rank's
(u, v) and rebuilds the exact sum: W's gradient U^T V with U, V the ranks' factors stacked (one
matmul), b's the column sums of U. Lossless: the gradient equals an allreduce's up to float summation
order. Ranks may hold different K (the gather is variable-size).
"""
from __future__ import annotations

import torch
from torch import nn

from sparcoll.compress.channel import Channel


class Factors:
    """Captures one nn.Linear's factors during a step: its inputs in forward, the gradients of its
    outputs in backward (a layer called several times a step gives several of each)."""

    def __init__(self, layer: nn.Linear):
        self.layer = layer
        self.inputs: list[torch.Tensor] = []
        self.output_grads: list[torch.Tensor] = []
        self.enabled = True

    def forward_hook(self, module, args, output) -> None:
        if not (self.enabled and torch.is_grad_enabled() and output.requires_grad):
            return
        self.inputs.append(args[0].detach().reshape(-1, self.layer.in_features))
        output.register_hook(self._output_grad)

    def _output_grad(self, grad: torch.Tensor) -> None:
        self.output_grads.append(grad.detach().reshape(-1, self.layer.out_features))

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(u, v) of this step, every call's rows stacked, and forget them. Output gradients arrive
        in reverse call order, so they are reversed to meet their inputs."""
        u = torch.cat(self.output_grads[::-1]) if self.output_grads else None
        v = torch.cat(self.inputs) if self.inputs else None
        self.clear()
        if u is None or v is None or u.shape[0] != v.shape[0]:
            raise RuntimeError("SFB needs every call of the layer to take part in the loss")
        return u.float().contiguous(), v.float().contiguous()

    def clear(self) -> None:
        self.inputs.clear()
        self.output_grads.clear()


def reduce_factors(u: torch.Tensor, v: torch.Tensor, channel: Channel,
                   bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The average over ranks of the layer's weight gradient (M x N) and bias gradient (M,), from
    every rank's factors: one variable-size allgather of (u, v)."""
    m, n = u.shape[1], v.shape[1]
    gathered = channel.allgather((u.reshape(-1), v.reshape(-1)), variable=True)
    big_u = torch.cat([parts[0].view(-1, m) for parts in gathered])
    big_v = torch.cat([parts[1].view(-1, n) for parts in gathered])
    weight = (big_u.t() @ big_v).div_(channel.world)
    return weight, (big_u.sum(0).div_(channel.world) if bias else None)
