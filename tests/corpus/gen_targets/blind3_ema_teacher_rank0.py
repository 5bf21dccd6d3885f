"""Bug: a mean-teacher consistency loss reads an EMA teacher (a frozen copy of the student inside the model), but train_step updates the EMA on rank 0 only, as one does for an EMA kept for evaluation: under DDP nothing broadcasts parameters after construction, so rank 1's teacher stays at the initial weights and its consistency targets go stale.

Report: "I'm wondering if I should only call the EMA function on rank 0 or on all gpus for a DDP setup" -
"just do rank 0" - "If just do rank 0, model copys on other devices should not know the updated parameters"
(lucidrains/ema-pytorch issue #9, where the EMA also feeds training through update_model_with_ema_every);
teacher updates under DDP with no reduce or broadcast (facebookresearch/unbiased-teacher issue #31).
Symptom: "the 2-GPU mean-teacher run drifts from 1 GPU from step 2; rank 0's and rank 1's teacher weights
differ after the first step".
Twin: every rank updates its teacher from its (identical) student after the optimizer step.
"""

import copy

import torch
import torch.nn.functional as F
from _base import HEALTHY, RANK
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distdiag.workloads.base import annotate, split_batch

ROWS, FEATURES, CLASSES, MOMENTUM, CONSISTENCY, LR = 8, 10, 4, 0.5, 5.0, 0.02


class MeanTeacher(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(FEATURES, 24), nn.GELU(), nn.Linear(24, CLASSES))
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)

    def forward(self, x, x_aug):
        with torch.no_grad():
            target = self.teacher(x_aug).softmax(-1)
        return self.student(x), self.student(x_aug), target


def build_model():
    return MeanTeacher()


def build_optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def parallelize(model, mesh):
    return DistributedDataParallel(model)


def make_batch(step):
    gen = torch.Generator().manual_seed(800 + step)
    x = torch.randn(ROWS, FEATURES, generator=gen)
    return {"x": x, "x_aug": x + 0.3 * torch.randn(ROWS, FEATURES, generator=gen),
            "y": torch.randint(0, CLASSES, (ROWS,), generator=gen)}


def shard_batch(batch, rank, world_size):
    return annotate(split_batch(batch, rank, world_size), world_size, ROWS)


def loss_fn(model, batch):
    logits, logits_aug, target = model(batch["x"], batch["x_aug"])
    total = F.cross_entropy(logits, batch["y"], reduction="sum")
    total = total + CONSISTENCY * F.mse_loss(logits_aug.softmax(-1), target, reduction="sum")
    return total * batch["world_size"] / batch["global_count"]


def train_step(model, batch, optimizer):
    loss = loss_fn(model, batch)
    loss.backward()
    optimizer.step()
    inner = getattr(model, "module", model)
    if HEALTHY or RANK == 0:  # the bug: the EMA is updated on rank 0 only
        with torch.no_grad():
            for t, s in zip(inner.teacher.parameters(), inner.student.parameters(), strict=True):
                t.lerp_(s, 1 - MOMENTUM)
    return loss
