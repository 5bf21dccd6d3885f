"""Bug: a nondeterministic op in the step (injected: CPU kernels at one thread are
deterministic, so the loss draws from a generator seeded from os.urandom, which no seed
controls: like an atomic-add kernel, each run gives different low bits)."""

import os

import torch
from _twin import HEALTHY

from distdiag.workloads import get_workload

_w = get_workload("transformer")
build_model, make_batch, shard_batch = _w.build_model, _w.make_batch, _w.shard_batch
_noise = torch.Generator().manual_seed(int.from_bytes(os.urandom(6), "little"))


def loss_fn(model, batch):
    loss = _w.loss_fn(model, batch)
    if not HEALTHY:
        # 1e-2 of relative noise: ~84,000 distinct float32 values near 1, so two runs give
        # the same bits once in ~10^5 (a smaller scale collapsed to a few values: a flaky test).
        loss = loss * (1 + 1e-2 * torch.rand((), generator=_noise, dtype=torch.float64)).float()
    return loss
