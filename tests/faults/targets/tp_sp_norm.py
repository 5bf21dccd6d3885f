"""Tensor + sequence parallel on every rank (one TP group, every rank the whole batch): the norm
runs sequence-parallel (SequenceParallel), so its Replicate weight's gradient is a Partial(sum)
DTensor: each rank holds the part from its own sequence positions. A correct plan: only the full
tensor (the sum over ranks) is the gradient. Bug: the norm is left out of the plan; it still
runs on this rank's positions (LayerNorm is per position), but its weight is a plain tensor whose
gradient holds this rank's positions only and is never summed over the ranks."""

import torch
import torch.nn.functional as F
from _twin import HEALTHY
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

BATCH, SEQ, DIM, CLASSES = 2, 8, 8, 4  # SEQ divisible by 2 and 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.relu(self.up(self.norm(x)))))


def build_model() -> nn.Module:
    torch.manual_seed(1234)
    return Net()


def make_batch(step: int) -> tuple:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, SEQ, DIM, generator=gen), torch.randint(0, CLASSES, (BATCH, SEQ), generator=gen)


def shard_batch(batch: tuple, rank: int, world: int) -> tuple:
    return batch  # tensor parallel only: every rank the whole batch


def loss_fn(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, CLASSES), y.reshape(-1))


def parallelize(model: nn.Module, mesh) -> nn.Module:
    # the whole sequence arrives on every rank; the norm takes this rank's positions
    parallelize_module(model, mesh, PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                       use_local_output=True))
    plan = {"norm": SequenceParallel()} if HEALTHY else {}
    return parallelize_module(model, mesh, {
        **plan,
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
