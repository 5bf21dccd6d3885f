"""Bug: a layer renamed since the checkpoint was written (fc1 -> proj_in)."""

import torch
from torch import nn


class Renamed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj_in = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.proj_in(x)))


def build_model():
    return Renamed()
