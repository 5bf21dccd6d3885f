"""Shared by the setup corpus targets: a tiny model with a frozen sub-module and a norm with
fixed (calibrated) running statistics, a global batch per step, FSDP2 per block, and which twin this is."""

import os

import torch
import torch.nn.functional as F
from torch import nn

HEALTHY = os.environ.get("DISTDIAG_TWIN") == "healthy"
RANK = int(os.environ.get("RANK", "0"))
DIM, CLASSES, BATCH = 8, 4, 12  # 12 rows split across 2, 3 or 4 ranks


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(DIM, DIM)  # a pretrained encoder: requires_grad False, loaded from a checkpoint
        self.frozen.requires_grad_(False)
        self.norm = nn.BatchNorm1d(DIM).eval()  # the encoder's calibrated normaliser: fixed statistics
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.frozen(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def checkpoint() -> dict:
    """The frozen encoder's pretrained weights, as a file read would give them."""
    gen = torch.Generator().manual_seed(7)
    return {"weight": torch.randn(DIM, DIM, generator=gen), "bias": torch.randn(DIM, generator=gen)}


def make_batch(step: int) -> tuple:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, DIM, generator=gen), torch.randint(0, CLASSES, (BATCH,), generator=gen)


def loss_fn(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)
