"""Bug: parallelize freezes the embedding "to save memory in the distributed run"; the single-process run trains it.

Report: "the multi-GPU run's embedding never changes; single GPU it does".
Twin: parallelize only shards (what it freezes, build_model freezes for both runs: nothing here).
"""

from _base import HEALTHY, build_model, loss_fn, make_batch, shard_batch  # noqa: F401
from torch.distributed.fsdp import fully_shard


def parallelize(model, mesh):
    if not HEALTHY:
        model.embed.requires_grad_(False)  # the bug: only on the parallel path
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
