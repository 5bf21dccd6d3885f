"""Bug: parallelize shards every block but blocks.1 and not the root: blocks.1 stays plain, unreduced.

Twin: every block and the root under fully_shard.
"""

import os

from _twin import HEALTHY
from torch.distributed.fsdp import fully_shard

from distdiag.workloads import get_workload

_w = get_workload("mlp", int(os.environ.get("WORLD_SIZE", "1")))
build_model, make_batch, loss_fn, shard_batch = _w.build_model, _w.make_batch, _w.loss_fn, _w.shard_batch


def parallelize(model, mesh):
    fully_shard(model.blocks[0], mesh=mesh)
    if HEALTHY:
        fully_shard(model.blocks[1], mesh=mesh)
    fully_shard(model.head, mesh=mesh)
    if HEALTHY:
        fully_shard(model, mesh=mesh)
    return model
