"""Bug: a SimCLR-style NT-Xent loss contrasts each view against the other views of this rank's rows only: nothing is gathered from the other ranks, so each rank's softmax has 2 x 4 - 1 candidates where the single-process run on the same global batch has 2 x 8 - 1. The 2-rank run optimises another loss than the 1-process run.

Report: "In the NT Xent loss, `out_1` and `out_2` are not gathered over the whole DDP process group. This is
a big issue as the loss is only classifying the correct pair over `local_batch_size*2` possible pairs instead
of over `world_size*local_batch_size*2` possible pairs" (Lightning-Universe/lightning-bolts issue #179);
"when we run training with DDP ... the loss is calculated with only the samples from the sub-batch on each
rank" (facebookresearch/vissl issue #474); microsoft/UniCL issue #5 ("I don't actually see where the features
are gathered across all GPUs"). Symptom: "the contrastive loss on 2 GPUs is lower than on 1 GPU with the same
global batch, from the first step".
Twin: the views are gathered from every rank with a differentiable all_gather
(`torch.distributed.nn.functional.all_gather`), so every anchor is contrasted with the global batch's 2 x 8
views, as in one process.
"""

import torch
import torch.nn.functional as F
from _base import HEALTHY
from torch import nn
from torch.distributed.nn.functional import all_gather

from distdiag.workloads.base import annotate, split_batch

ROWS, FEATURES, HIDDEN, EMBED, TEMPERATURE = 8, 12, 24, 8, 0.5


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(FEATURES, HIDDEN), nn.Linear(HIDDEN, HIDDEN)])
        self.proj = nn.Linear(HIDDEN, EMBED)

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return F.normalize(self.proj(x), dim=-1)


def build_model():
    return Encoder()


def make_batch(step):
    gen = torch.Generator().manual_seed(1300 + step)
    x = torch.randn(ROWS, FEATURES, generator=gen)
    return {"view1": x + 0.3 * torch.randn(ROWS, FEATURES, generator=gen),
            "view2": x + 0.3 * torch.randn(ROWS, FEATURES, generator=gen)}


def shard_batch(batch, rank, world_size):
    part = annotate(split_batch(batch, rank, world_size), world_size, 2 * ROWS)
    part["rank"] = rank
    return part


def loss_fn(model, batch):
    world, rank = batch["world_size"], batch["rank"]
    z = torch.cat([model(batch["view1"]), model(batch["view2"])])  # [2n, d]: this rank's views
    n2 = z.shape[0]
    local = torch.arange(n2, device=z.device)
    positive = (local + n2 // 2) % n2
    if HEALTHY and world > 1:
        candidates = torch.cat(all_gather(z))  # every rank's views, the gradient flowing back to their owners
        offset = rank * n2
    else:
        candidates, offset = z, 0  # the bug (world > 1): this rank's views only
    own = torch.zeros(n2, candidates.shape[0], dtype=torch.bool, device=z.device)
    own[local, local + offset] = True  # not an anchor's own view
    sim = (z @ candidates.T / TEMPERATURE).masked_fill(own, float("-inf"))
    return F.cross_entropy(sim, positive + offset, reduction="sum") * world / batch["global_count"]
