"""Bug: the model's branches are built in the iteration order of a set of names, after one
seed on every rank. Each rank of its own interpreter (torchrun) has its own Python hash seed, so
its own set order: the same branch gets different initial weights on each rank. Forked ranks
share the launching process's seed and cannot show it. Twin: the names sorted."""

import torch
import torch.nn.functional as F
from _twin import HEALTHY
from torch import nn

NAMES = {f"branch_{c}" for c in "abcdefghijklmnop"}  # 16 names: two seeds give one order ~never
DIM, CLASSES, BATCH = 8, 4, 12


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        order = sorted(NAMES) if HEALTHY else list(NAMES)
        self.branches = nn.ModuleDict({name: nn.Linear(DIM, DIM) for name in order})
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.stack([self.branches[n](x) for n in sorted(self.branches)]).sum(0))


def build_model() -> nn.Module:
    torch.manual_seed(1234)
    return Net()


def make_batch(step: int) -> tuple:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, DIM, generator=gen), torch.randint(0, CLASSES, (BATCH,), generator=gen)


def loss_fn(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)
