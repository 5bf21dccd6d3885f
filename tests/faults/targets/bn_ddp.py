"""Bug: BatchNorm under DDP without SyncBatchNorm: each rank normalises with its own half of
the batch's statistics (the ranks hold equal counts), so every gradient upstream of the norm and
its running statistics differ from one process on the global batch. Twin: the norm's statistics
summed over the data-parallel group (what SyncBatchNorm does; written out here, since
SyncBatchNorm runs on GPUs only). In both, the bias of the Linear before the norm has a gradient
that the normalisation cancels: zero up to rounding in the reference and on the ranks."""

import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from _twin import HEALTHY
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

# the autograd-aware all-reduce SyncBatchNorm's own backward relies on; its successor has no autograd yet
warnings.filterwarnings("ignore", message="torch.distributed.nn.functional.all_reduce is deprecated")

DIM, CLASSES, BATCH = 8, 4, 24  # 24 rows: equal counts on 2, 3 or 4 ranks


class GlobalBatchNorm(nn.Module):
    """Batch statistics over the whole data-parallel batch (an autograd all-reduce of the sums)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim)), eps
        self.group: dist.ProcessGroup | None = None  # set by parallelize; None in the reference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sums = torch.cat([x.sum(0), (x * x).sum(0), x.new_full((1,), float(x.shape[0]))])
        if self.group is not None:
            sums = dist_fn.all_reduce(sums, group=self.group)
        d = x.shape[1]
        count = sums[-1]
        mean, var = sums[:d] / count, sums[d : 2 * d] / count - (sums[:d] / count) ** 2
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)  # its bias feeds the norm: a gradient of zero up to rounding
        self.norm = GlobalBatchNorm(DIM) if HEALTHY else nn.BatchNorm1d(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.norm(self.proj(x))))


def build_model() -> nn.Module:
    torch.manual_seed(1234)
    return Net()


def make_batch(step: int) -> tuple:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, DIM, generator=gen) * 3 + 1, torch.randint(0, CLASSES, (BATCH,), generator=gen)


def shard_batch(batch: tuple, rank: int, world: int) -> tuple:
    x, y = batch
    per = x.shape[0] // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def loss_fn(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def parallelize(model: nn.Module, mesh) -> nn.Module:
    if HEALTHY:
        model.norm.group = mesh.get_group()
    return DDP(model, process_group=mesh.get_group())
