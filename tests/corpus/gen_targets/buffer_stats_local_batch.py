"""Bug: an input normaliser's running mean/var buffers are updated in forward from the rank's own rows (no all-reduce).

Report: "after a few hundred steps the feature normaliser's statistics differ between ranks; eval on rank 0 and rank 1 disagree".
Twin: the normaliser's statistics frozen after calibration (updated from nothing per rank).
"""

import torch
from _base import HEALTHY
from torch import nn

DIM = 8


class Normaliser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(DIM))
        self.register_buffer("var", torch.ones(DIM))

    def forward(self, x):
        if self.training and not HEALTHY:  # the bug: statistics of this rank's rows only
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
                self.var.mul_(0.9).add_(0.1 * x.var(0))
        return (x - self.mean) / (self.var + 1e-5).sqrt()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.normaliser = Normaliser()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(DIM, 4)

    def forward(self, x):
        x = self.normaliser(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model():
    return Net()


def make_batch(step):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, DIM, generator=gen) * 3 + 1, torch.randint(0, 4, (8,), generator=gen)


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)
