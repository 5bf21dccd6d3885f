"""Shared by the data corpus targets: a dataset of 96 distinct samples, and which twin this is."""

import os

import torch
from torch.utils.data import TensorDataset

HEALTHY = os.environ.get("DISTDIAG_TWIN") == "healthy"
SAMPLES, DIM, BATCH = 96, 4, 4


def dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(SAMPLES, DIM, generator=gen), torch.arange(SAMPLES))
