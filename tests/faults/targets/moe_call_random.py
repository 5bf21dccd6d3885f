"""Bug: router noise drawn on every call (same tokens, different experts the second time)."""

import torch
from moe_healthy import _ROUTER, build_model, loss_fn, make_batch, shard_batch  # noqa: F401


def route(tokens):
    logits = _ROUTER(tokens) + torch.randn(tokens.shape[0], 4)  # the bug: unseeded noise per call
    return torch.softmax(logits, dim=-1).topk(2, dim=-1).indices
