"""Bug: the model is now wrapped (keys gain `module.`) but the checkpoint was written without the wrapper."""

from ckpt_healthy import Net
from torch import nn


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module = Net()

    def forward(self, x):
        return self.module(x)


def build_model():
    return Wrapper()
