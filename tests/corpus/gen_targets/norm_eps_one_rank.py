"""Bug: parallelize sets the final LayerNorm's eps from a per-node setting that rank 1 reads as 0.1.

Report: "2-GPU loss differs from 1-GPU from the first step; only the last rank's numbers look off".
Twin: eps stays at its default (1e-5) on every rank.
"""

from _base import HEALTHY, RANK, build_model, loss_fn, make_batch, shard_batch  # noqa: F401
from torch.distributed.fsdp import fully_shard


def parallelize(model, mesh):
    if not HEALTHY and RANK == 1:
        model.norm.eps = 0.1  # the bug: a per-node config value on the parallel path only
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
