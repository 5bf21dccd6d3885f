"""Bug: parallelize runs the model's weight init after fully_shard, on each rank's local shard, from one seed: every rank draws the same numbers for its own slice, so the shards repeat and no rank holds the single-process init.

Report: "ensure sharded parameters initialized different on different ranks" (allenai/OLMo-core pull
request #307: with one init seed on every rank, sharded parameters got the same values on each rank);
single-device-equal initialisation of sharded parameters: pytorch/pytorch issue #140301.
Symptom: "the 2-GPU run starts from a higher loss than 1 GPU with the same seed".
Twin: the init runs on the whole parameters before fully_shard (as build_model does for the single run).
"""

import torch
from _base import HEALTHY, loss_fn, make_batch, shard_batch  # noqa: F401
from _base import build_model as _build
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

INIT_SEED = 7


def init_weights(model):
    torch.manual_seed(INIT_SEED)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                (p.to_local() if isinstance(p, DTensor) else p).normal_(0.0, 0.1)


def build_model():
    model = _build()
    init_weights(model)
    return model


def parallelize(model, mesh):
    if HEALTHY:
        init_weights(model)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not HEALTHY:
        init_weights(model)  # the bug: on the local shards, the same seed on every rank
    return model
