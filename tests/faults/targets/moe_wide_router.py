"""Healthy: a deterministic top-2 router over 32-wide hidden states (the probe's made-up tokens
are 16 wide unless probes.moe_routing.hidden_dim says 32)."""

import torch

_ROUTER = torch.nn.Linear(32, 4, bias=False)
torch.nn.init.normal_(_ROUTER.weight, generator=torch.Generator().manual_seed(5))


def route(tokens):
    scores = torch.softmax(_ROUTER(tokens), dim=-1)
    return scores.topk(2, dim=-1).indices, scores
