"""Bug: the whole model is cast to float16 (model.half()) and the optimizer then updates float16
weights with no float32 master copy. Twin: float32 weights, float16 compute left to autocast
(here bfloat16 autocast, which works on CPU), the loss inside the autocast region."""

import torch
import torch.nn.functional as F
from _common import HEALTHY, Net, make_batch  # noqa: F401


def build_model():
    model = Net()
    return model if HEALTHY else model.half()


def loss_fn(model, batch):
    x, y = batch
    if HEALTHY:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.cross_entropy(model(x), y)
    return F.cross_entropy(model(x.half()).float(), y)
