"""Bug: the norm's running statistics are calibrated at build time on this rank's own data
shard, so the buffer differs per rank (and FSDP never reduces buffers). Twin: calibrated on
the global calibration batch, the same on every rank."""

import torch
from _common import BATCH, HEALTHY, RANK, Net, loss_fn, make_batch  # noqa: F401


def build_model():
    model = Net()
    x, _ = make_batch(0)
    if not HEALTHY:
        per = BATCH // 2
        x = x[(RANK % 2) * per:(RANK % 2 + 1) * per]
    with torch.no_grad():
        h = model.frozen(x)
        model.norm.running_mean.copy_(h.mean(0))
        model.norm.running_var.copy_(h.var(0))
    return model
