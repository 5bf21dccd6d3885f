"""Bugs of the sharding plan: a tied embedding/head weight sharded by two separate
fully_shard calls (the tie breaks), and gradients reduced in bfloat16 for float32 weights.
The healthy twin shards the blocks, then the root (which holds both users of the tie)."""

import torch
from _twin import HEALTHY
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from distdiag.workloads import get_workload

_w = get_workload("transformer")
make_batch, loss_fn, shard_batch = _w.make_batch, _w.loss_fn, _w.shard_batch


def build_model():
    model = _w.build_model()
    model.head.weight = model.embed.weight  # tied input/output embedding
    return model


def parallelize(model, mesh):
    low = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **({} if HEALTHY else {"mp_policy": low}))
    if not HEALTHY:
        fully_shard(model.embed, mesh=mesh)
        fully_shard(model.head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
