"""Bug: rank 0 runs a validation pass before training and never calls model.train() again: its dropout is off.

Report: "rank 0's training loss is consistently lower than the other ranks' (dropout 0.1)".
Twin: model.train() after the validation pass on rank 0.
"""

import torch
from _base import HEALTHY, RANK
from torch import nn

DIM = 8


def build_model():
    model = nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4))
    if RANK == 0:
        model.eval()  # a validation pass on rank 0
        with torch.no_grad():
            model(torch.zeros(1, DIM))
        if HEALTHY:
            model.train()
    return model


def make_batch(step):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, DIM, generator=gen), torch.randint(0, 4, (8,), generator=gen)


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)
