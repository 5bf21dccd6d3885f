"""Bug: a CLIP-style contrastive loss gathers every rank's text embeddings (with gradient) as the logits' columns, but keeps `labels = arange(local_batch)`: on rank r > 0 each image's target column is a text of rank 0's rows, not its own pair (which sits at column r x local_batch + i).

Report: the labels must follow the layout of the logits' columns: "labels = (torch.arange(N) + N *
torch.distributed.get_rank())" questioned, and "The contrastive code indeed has a bug in multiple GPU
training" (nomewang/M3DM issue #7); lightly-ai/lightly pull request #1177 ("the labels were wrongly
calculated ... we would increase the labels by `rank * batch_size` which is incorrect as the logits are only
calculated from the current rank"): the same mismatch, here the other way round (gathered columns, labels not
offset). Symptom: "on 2 GPUs the contrastive loss plateaus higher than on 1 GPU with the same global batch;
rank 1's loss is much larger than rank 0's".
Twin: `labels = arange(local_batch) + rank x local_batch`, the positive pairs' columns in the gathered
matrix.
"""

import torch
import torch.nn.functional as F
from _base import HEALTHY
from torch import nn
from torch.distributed.fsdp import fully_shard

from distdiag.workloads.base import annotate, split_batch
from distdiag.workloads.sequence import _GatherSeq

ROWS, IMAGE, TEXT, EMBED = 8, 10, 6, 8


class Clip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(IMAGE, 16), nn.GELU(), nn.Linear(16, EMBED))
        self.text = nn.Sequential(nn.Linear(TEXT, 16), nn.GELU(), nn.Linear(16, EMBED))
        self.logit_scale = nn.Parameter(torch.full((1,), 2.0))  # 1-D: fully_shard refuses scalars

    def forward(self, image, text):
        return F.normalize(self.image(image), dim=-1), F.normalize(self.text(text), dim=-1), self.logit_scale.exp()


def build_model():
    return Clip()


def parallelize(model, mesh):
    fully_shard(model.image, mesh=mesh)
    fully_shard(model.text, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def make_batch(step):
    gen = torch.Generator().manual_seed(600 + step)
    image = torch.randn(ROWS, IMAGE, generator=gen)
    text = image[:, :TEXT] + 0.3 * torch.randn(ROWS, TEXT, generator=gen)
    return {"image": image, "text": text}


def shard_batch(batch, rank, world_size):
    part = annotate(split_batch(batch, rank, world_size), world_size, ROWS)
    part["rank"] = rank
    return part


def loss_fn(model, batch):
    zi, zt, scale = model(batch["image"], batch["text"])
    world, rank, n = batch["world_size"], batch["rank"], zi.shape[0]
    all_i, all_t = (zi, zt) if world == 1 else (_GatherSeq.apply(zi, 0, None), _GatherSeq.apply(zt, 0, None))
    labels = torch.arange(n) + (rank * n if HEALTHY else 0)  # the bug: no offset into the gathered columns
    total = F.cross_entropy(scale * zi @ all_t.T, labels, reduction="sum")
    total = total + F.cross_entropy(scale * zt @ all_i.T, labels, reduction="sum")
    return total * world / (2 * batch["global_count"])
