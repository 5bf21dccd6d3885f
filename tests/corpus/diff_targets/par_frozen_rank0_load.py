"""Bug: a frozen embedding is "loaded" (here: set from a fixed generator) on rank 0 only, before fully_shard.

fully_shard shards each rank's own copy, so rank 1's shards keep the random init: the model
the ranks train together is neither rank's. Twin: every rank loads it.
"""

import torch
from _par_base import workload
from _twin import HEALTHY, RANK

_w = workload
make_batch, shard_batch, loss_fn = _w.make_batch, _w.shard_batch, _w.loss_fn


def build_model():
    model = _w.build_model()
    model.embed.weight.requires_grad_(False)  # a frozen, pretrained part
    if HEALTHY or RANK == 0:  # the bug: only rank 0 loads the pretrained weights
        with torch.no_grad():
            model.embed.weight.copy_(torch.randn(model.embed.weight.shape, generator=torch.Generator().manual_seed(7)))
    return model
