"""Bug: router jitter seeded by the rank: each call repeats, but ranks route the same tokens differently."""

import torch
import torch.distributed as dist
from moe_healthy import _ROUTER, build_model, loss_fn, make_batch, shard_batch  # noqa: F401


def route(tokens):
    gen = torch.Generator().manual_seed(dist.get_rank())  # the bug: a per-rank seed
    logits = _ROUTER(tokens) + torch.randn(tokens.shape[0], 4, generator=gen)
    return torch.softmax(logits, dim=-1).topk(2, dim=-1).indices
