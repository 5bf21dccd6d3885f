"""Bug: HSDP (2 replicas x 2 shards); after fully_shard the sharded checkpoint is read only by
the first replica group (ranks 0-1), as if the replicas' all-reduce would carry it to the
others: the copies of every shard differ before the first step. Twin: every rank reads its
shard."""

import torch
from _common import HEALTHY, Net, loss_fn, make_batch  # noqa: F401
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def build_model():
    return Net()


def _read_shard(model, shard: int) -> None:
    """This rank's slice of each parameter, as a sharded (DCP) checkpoint read gives it."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            local = p.to_local()
            gen = torch.Generator().manual_seed(100 * i + shard)
            local.copy_(torch.randn(local.shape, generator=gen))


def parallelize(model, mesh):
    hsdp = init_device_mesh("cpu", (2, mesh.size() // 2), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=hsdp)
    fully_shard(model, mesh=hsdp)
    replica, shard = hsdp.get_coordinate()
    if HEALTHY or replica == 0:
        _read_shard(model, shard)
