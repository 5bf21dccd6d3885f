"""Bug: a forward hook scales the token embedding by sqrt(dim) (a Gemma-style `normalize_embeddings` option) from a config only rank 1 reads.

Report: "rank 1's loss is much higher than rank 0's from step 1; 1-GPU matches rank 0".
Twin: no embedding scale on any rank.
"""

import math

from _base import HEALTHY, RANK, build_model, loss_fn, make_batch, shard_batch  # noqa: F401
from torch.distributed.fsdp import fully_shard

NORMALIZE = {0: False, 1: True}


def parallelize(model, mesh):
    if not HEALTHY and NORMALIZE[RANK % 2]:
        scale = math.sqrt(model.embed.embedding_dim)
        model.embed.register_forward_hook(lambda mod, args, out: out * scale)  # the bug: rank 1 only
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
