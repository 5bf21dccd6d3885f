"""Bug: the FSDP2 MixedPrecisionPolicy comes from a per-node setting that differs: rank 1
reduces gradients in bfloat16, rank 0 in float32 (both compute in bfloat16). Twin: one
policy on every rank."""

import torch
from _common import HEALTHY, RANK, Net, loss_fn, make_batch  # noqa: F401
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def build_model():
    return Net()


def parallelize(model, mesh):
    reduce = torch.bfloat16 if (RANK == 1 and not HEALTHY) else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
