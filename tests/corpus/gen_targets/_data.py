"""Shared by the data targets: a dataset of 98 distinct samples (98 = 2 x 49: equal halves, odd per rank)."""

import torch
from torch.utils.data import TensorDataset

SAMPLES, DIM, BATCH = 98, 4, 4


def dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(SAMPLES, DIM, generator=gen), torch.arange(SAMPLES))
