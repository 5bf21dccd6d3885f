"""Bug: a diffusion-style denoising loss draws each row's noise and noise level from the global RNG (`torch.randn_like`, `torch.rand`), which every rank seeded with the same seed: rank 1's rows get exactly the noise rank 0's rows get, so the global batch holds each noise draw twice and none of the draws the single-process run makes for rows 4-7.

Report: "set_seed is called with the same seed on every rank ... The flow-matching noise and timesteps are
then sampled from that RNG ... all ranks draw **identical** noise and timestep values at every step"
(Robbyant/lingbot-vla-v2 issue #41); "The same seed seems to be used by every GPU, so using multi-GPU produces
the same result as just using 1" (threestudio-project/threestudio issue #195). Symptom: "adding GPUs does not
help the denoiser the way a larger batch on one GPU does; the 2-GPU run differs from 1 GPU from the first
step".
Twin: each row's noise and level come from a generator keyed by the sample's global id (the fix that makes
the draws independent of how the batch is split; `seed + rank` would decorrelate the ranks but not reproduce
the single-process draws).
"""

import torch
import torch.nn.functional as F
from _base import HEALTHY
from torch import nn
from torch.distributed.fsdp import fully_shard

from distdiag.workloads.base import annotate, split_batch

ROWS, FEATURES, HIDDEN = 8, 12, 32


class Denoiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(FEATURES + 1, HIDDEN), nn.Linear(HIDDEN, HIDDEN)])
        self.out = nn.Linear(HIDDEN, FEATURES)

    def forward(self, x, level):
        h = torch.cat([x, level[:, None]], dim=-1)
        for layer in self.layers:
            h = F.silu(layer(h))
        return self.out(h)


def build_model():
    return Denoiser()


def parallelize(model, mesh):
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def make_batch(step):
    gen = torch.Generator().manual_seed(700 + step)
    return {"x": torch.randn(ROWS, FEATURES, generator=gen), "sample_id": torch.arange(ROWS) + ROWS * step}


def shard_batch(batch, rank, world_size):
    return annotate(split_batch(batch, rank, world_size), world_size, ROWS)


def _draws(x, sample_id):
    if not HEALTHY:
        return torch.randn_like(x), torch.rand(x.shape[0])  # the bug: the global RNG, seeded alike on every rank
    noise, level = [], []
    for sid in sample_id.tolist():
        gen = torch.Generator().manual_seed(10_000 + sid)
        noise.append(torch.randn(x.shape[1], generator=gen))
        level.append(torch.rand((), generator=gen))
    return torch.stack(noise), torch.stack(level)


def loss_fn(model, batch):
    x = batch["x"]
    noise, level = _draws(x, batch["sample_id"])
    noisy = level.sqrt()[:, None] * x + (1 - level).sqrt()[:, None] * noise
    total = F.mse_loss(model(noisy, level), noise, reduction="sum")
    return total * batch["world_size"] / batch["global_count"]
