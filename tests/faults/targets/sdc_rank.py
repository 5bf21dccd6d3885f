"""Bug: one rank computes different bits for the same computation (injected silent data
corruption: on the rank named by DISTDIAG_SDC_RANK, the loss is off by one part in 1e7)."""

import os

from _twin import HEALTHY, RANK

from distdiag.workloads import get_workload

_w = get_workload("transformer", batch=12)  # 12 rows: splits across 2, 3, 4 or 6 ranks
build_model, make_batch, shard_batch = _w.build_model, _w.make_batch, _w.shard_batch
_BAD = int(os.environ.get("DISTDIAG_SDC_RANK", "-1"))


def loss_fn(model, batch):
    loss = _w.loss_fn(model, batch)
    if not HEALTHY and RANK == _BAD:
        loss = loss * (1 + 1e-7)
    return loss
