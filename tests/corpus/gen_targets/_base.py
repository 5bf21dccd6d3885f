"""Shared by the generalisation targets: which of the two runs (DISTDIAG_TWIN=healthy: the fixed twin),
this process's rank, and the built-in transformer workload's hooks sized for the world."""

import os

from distdiag.workloads import get_workload

HEALTHY = os.environ.get("DISTDIAG_TWIN") == "healthy"
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))

workload = get_workload("transformer", WORLD)
build_model, make_batch, shard_batch, loss_fn = workload.build_model, workload.make_batch, workload.shard_batch, workload.loss_fn
