"""Bug: the forward runs under bfloat16 autocast, but the loss is computed after the autocast
block, on bfloat16 logits: cross_entropy then runs (and returns) in bfloat16. Twin: the loss
inside the autocast region, where autocast runs cross_entropy in float32."""

import torch
import torch.nn.functional as F
from _common import HEALTHY, Net, make_batch  # noqa: F401


def build_model():
    return Net()


def loss_fn(model, batch):
    x, y = batch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
        if HEALTHY:
            return F.cross_entropy(logits, y)
    return F.cross_entropy(logits, y)
