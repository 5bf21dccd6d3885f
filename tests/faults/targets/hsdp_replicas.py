"""Bug: HSDP meant as 2 replicas x 2 shards, but fully_shard is given the shard sub-mesh
instead of the 2-D mesh: each replica group is an FSDP job of its own, nothing reduces
across the replicas, and the copies of every shard drift. The twin passes the 2-D mesh."""

from _twin import HEALTHY
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from distdiag.workloads import get_workload

_w = get_workload("transformer")
build_model, make_batch, loss_fn, shard_batch = _w.build_model, _w.make_batch, _w.loss_fn, _w.shard_batch


def parallelize(model, mesh):
    world = mesh.size()
    hsdp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    use = hsdp if HEALTHY else hsdp["shard"]
    for layer in model.layers:
        fully_shard(layer, mesh=use)
    fully_shard(model, mesh=use)
    return model
