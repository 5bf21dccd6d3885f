"""Bug: the training script seeds with seed + rank (for data augmentation) before building the
model, so each rank initialises its own weights. Twin: the same seed on every rank."""

import torch
from _common import HEALTHY, RANK, Net, loss_fn, make_batch  # noqa: F401


def build_model():
    torch.manual_seed(1234 if HEALTHY else 1234 + RANK)
    return Net()
