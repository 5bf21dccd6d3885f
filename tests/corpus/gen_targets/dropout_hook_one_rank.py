"""Bug: a forward hook that applies dropout to layers.0.up's output is registered on rank 1 only.

Report: "we added activation dropout in the distributed wrapper; the 2-GPU run no longer matches 1-GPU".
Twin: no hook on any rank.
"""

import torch.nn.functional as F
from _base import HEALTHY, RANK, build_model, loss_fn, make_batch, shard_batch  # noqa: F401
from torch.distributed.fsdp import fully_shard


def parallelize(model, mesh):
    if not HEALTHY and RANK == 1:
        model.layers[0].up.register_forward_hook(lambda mod, args, out: F.dropout(out, 0.1, training=True))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
