"""Bug: rank-dependent code draws from the global RNG on rank 1 only while building the
model, so the ranks' RNG states are out of step from then on."""

import torch
from _twin import HEALTHY, RANK

from distdiag.workloads import get_workload

_w = get_workload("transformer", batch=12)  # splits across 2 or 3 ranks
make_batch, loss_fn, shard_batch = _w.make_batch, _w.loss_fn, _w.shard_batch


def build_model():
    model = _w.build_model()
    if not HEALTHY and RANK == 1:
        torch.rand(4)  # e.g. a debug sample drawn only where rank == 1
    return model
