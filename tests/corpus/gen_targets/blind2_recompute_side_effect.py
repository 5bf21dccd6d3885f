"""Bug: a block ramps its residual branch in with a step counter that its forward increments; parallelize puts every block under activation checkpointing, whose recompute in the backward runs that forward again: the counter advances twice per step, and the backward differentiates a forward with another ramp than the one that made the loss.

Report: "activation-checkpoint replay must not execute operations registered with side effects a second
time ... prevents ordered runtime state from advancing twice during one forward/backward pair"
(pytorch/torchtitan pull request #4568). Symptom: "turning on activation checkpointing changes the
gradients from the first step; without it the multi-GPU run matches 1 GPU".
Twin: the counter advances in train_step, once per step; the checkpointed forward only reads it.
"""

import torch
import torch.nn.functional as F
from _base import HEALTHY
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.fsdp import fully_shard

from distdiag.workloads.base import annotate, split_batch

ROWS, DIM, CLASSES, RAMP_STEPS = 8, 16, 4, 10


class Block(nn.Module):
    def __init__(self, ramped: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)
        self.ramped = ramped
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        if self.ramped and self.training and not HEALTHY:
            self.steps += 1  # the bug: a side effect in a forward that checkpointing recomputes
        ramp = torch.clamp(self.steps / RAMP_STEPS, max=1.0) if self.ramped else 1.0
        return x + ramp * self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList([Block(False), Block(True)])
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_model():
    return Net()


def parallelize(model, mesh):
    for layer in model.layers:
        checkpoint(layer)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def make_batch(step):
    gen = torch.Generator().manual_seed(300 + step)
    return {"x": torch.randn(ROWS, DIM, generator=gen), "y": torch.randint(0, CLASSES, (ROWS,), generator=gen)}


def shard_batch(batch, rank, world_size):
    return annotate(split_batch(batch, rank, world_size), world_size, ROWS)


def loss_fn(model, batch):
    total = F.cross_entropy(model(batch["x"]), batch["y"], reduction="sum")
    return total * batch["world_size"] / batch["global_count"]


def train_step(model, batch, optimizer):
    if HEALTHY:
        for layer in model.layers:
            if layer.ramped:
                layer.steps += 1
    loss = loss_fn(model, batch)
    loss.backward()
    optimizer.step()
    return loss
