"""Bug: the final norm's parameters are kept out of FSDP (ignored_params), so their
gradients are never all-reduced: each rank updates them from its own shard of the batch."""

from _twin import HEALTHY
from torch.distributed.fsdp import fully_shard

from distdiag.workloads import get_workload

_w = get_workload("transformer")
build_model, make_batch, loss_fn, shard_batch = _w.build_model, _w.make_batch, _w.loss_fn, _w.shard_batch


def parallelize(model, mesh):
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    ignored = None if HEALTHY else {model.norm.weight, model.norm.bias}
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    return model
