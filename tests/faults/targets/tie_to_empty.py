"""Bug: parallelize builds the model on the meta device and materialises it with to_empty() before
loading the weights: to_empty gives head.weight and embed.weight storage of their own, so the tie
is gone before fully_shard ever runs (both stay in the root's FSDP group). The healthy twin ties
them again right after to_empty."""

import torch
from _twin import HEALTHY
from torch.distributed.fsdp import fully_shard

from distdiag.workloads import get_workload

_w = get_workload("transformer")
make_batch, loss_fn, shard_batch = _w.make_batch, _w.loss_fn, _w.shard_batch


def _tie(model):
    model.head.weight = model.embed.weight  # tied input/output embedding
    return model


def build_model():
    return _tie(_w.build_model())


def parallelize(model, mesh):
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.device("meta"):
        fresh = _w.build_model()
    fresh.to_empty(device="cpu")  # FAULT: one tensor per name
    if HEALTHY:
        _tie(fresh)
    fresh.load_state_dict(weights)
    for layer in fresh.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fresh, mesh=mesh)
    return fresh
