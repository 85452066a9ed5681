"""An identity module whose backward sleeps: a known gap in backward for the tests that time it."""
import time

import torch
from torch import nn


class Pause(nn.Module):
    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        return _Sleep.apply(x, self.seconds)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None
