"""Bug: a DDP student with an EMA teacher inside the model (requires_grad=False), whose update
runs on rank 0 only (as for an EMA kept for evaluation); its outputs are the student's targets,
so rank 1 trains against a stale teacher. param_sync must say the teacher was moved outside
the optimizer on some ranks, not that its gradients went unreduced (it has none). Twin: every
rank updates its teacher after the optimizer step."""

import copy

import torch
import torch.nn.functional as F
from _twin import HEALTHY, RANK
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

DIM, CLASSES, BATCH, DECAY = 6, 3, 12, 0.8


class Distilled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, CLASSES))
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            soft = self.teacher(x).softmax(-1)
        return self.student(x), soft


def build_model() -> nn.Module:
    torch.manual_seed(7)
    return Distilled()


def parallelize(model: nn.Module, mesh) -> nn.Module:
    return DDP(model)


def make_batch(step: int) -> tuple:
    gen = torch.Generator().manual_seed(40 + step)
    return torch.randn(BATCH, DIM, generator=gen), torch.randint(0, CLASSES, (BATCH,), generator=gen)


def shard_batch(batch: tuple, rank: int, world: int) -> tuple:
    x, y = batch
    per = x.shape[0] // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def loss_fn(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    logits, soft = model(x)
    return F.cross_entropy(logits, y) + 2.0 * F.mse_loss(logits.softmax(-1), soft)


def train_step(model: nn.Module, batch: tuple, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    loss = loss_fn(model, batch)
    loss.backward()
    optimizer.step()
    inner = getattr(model, "module", model)
    if HEALTHY or RANK == 0:  # FAULT: the teacher's EMA on rank 0 only
        with torch.no_grad():
            for t, s in zip(inner.teacher.parameters(), inner.student.parameters(), strict=True):
                t.mul_(DECAY).add_(s, alpha=1 - DECAY)
    return loss
