"""Bug: a two-tower contrastive loss gathers the other ranks' embeddings with `dist.all_gather`, which carries no gradient: only this rank's own slice (put back in the gathered list) is differentiable.

Report: "you need to manually propagate gradients through all_gather, as it doesn't auto-bp"
(HobbitLong/SupContrast issue #26); "your gather implementation doesn't cut off the gradient, which
answers exactly the main issue" (facebookresearch/vissl issue #474). Symptom: "the 2-GPU contrastive run
learns slower than 1 GPU with the same global batch; the loss values match at step 1".
Twin: the gather is differentiable (all_gather forward; backward sums the gradient over ranks and keeps
this rank's slice).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _base import HEALTHY
from torch import nn
from torch.distributed.fsdp import fully_shard

from distdiag.workloads.base import annotate, split_batch
from distdiag.workloads.sequence import _GatherSeq

ROWS, FEATURES, TEMPERATURE = 8, 12, 0.2


class Towers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Sequential(nn.Linear(FEATURES, 16), nn.GELU(), nn.Linear(16, 8))
        self.doc = nn.Sequential(nn.Linear(FEATURES, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, q, d):
        return F.normalize(self.query(q), dim=-1), F.normalize(self.doc(d), dim=-1)


def build_model():
    return Towers()


def parallelize(model, mesh):
    fully_shard(model.query, mesh=mesh)
    fully_shard(model.doc, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def make_batch(step):
    gen = torch.Generator().manual_seed(500 + step)
    q = torch.randn(ROWS, FEATURES, generator=gen)
    return {"q": q, "d": q + 0.5 * torch.randn(ROWS, FEATURES, generator=gen)}


def shard_batch(batch, rank, world_size):
    part = annotate(split_batch(batch, rank, world_size), world_size, ROWS)
    part["rank"] = rank
    return part


def _gather(z, rank, world):
    if HEALTHY:
        return _GatherSeq.apply(z, 0, None)
    parts = [torch.empty_like(z) for _ in range(world)]
    dist.all_gather(parts, z.detach().contiguous())  # the bug: no gradient flows back to the other ranks
    parts[rank] = z
    return torch.cat(parts)


def loss_fn(model, batch):
    zq, zd = model(batch["q"], batch["d"])
    world, rank, n = batch["world_size"], batch["rank"], zq.shape[0]
    all_q, all_d = (zq, zd) if world == 1 else (_gather(zq, rank, world), _gather(zd, rank, world))
    labels = torch.arange(n) + rank * n
    total = F.cross_entropy(zq @ all_d.T / TEMPERATURE, labels, reduction="sum")
    total = total + F.cross_entropy(zd @ all_q.T / TEMPERATURE, labels, reduction="sum")
    return total * world / (2 * batch["global_count"])
