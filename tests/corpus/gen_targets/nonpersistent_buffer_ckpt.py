"""Bug: a step counter that drives the model's warmup is a buffer registered persistent=False: checkpoints drop it, a resumed run restarts warmup.

Report: "after resuming from a DCP checkpoint the loss jumps: the warmup factor is back at 0".
Twin: the counter registered persistent (saved and loaded with the model).
"""

import torch
from _base import HEALTHY
from torch import nn

DIM = 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("step_count", torch.zeros((), dtype=torch.float32), persistent=HEALTHY)
        self.body = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 4)

    def forward(self, x):
        if self.training:
            self.step_count += 1
        warm = torch.clamp(self.step_count / 100.0, max=1.0)
        return self.head(torch.tanh(self.body(x)) * warm)


def build_model():
    return Net()


def make_batch(step):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, DIM, generator=gen), torch.randint(0, 4, (8,), generator=gen)


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)
