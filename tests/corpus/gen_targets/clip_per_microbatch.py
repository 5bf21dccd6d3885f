"""Bug: clip_grad_norm_ is called inside the accumulation loop, after each micro-batch's backward, instead of once after the last.

Report: "with accumulation the gradient norm is capped per micro-batch; results change with the number of micro-batches".
Twin: one clip after the last micro-batch.
"""

import torch
from _base import HEALTHY, build_model, loss_fn, make_batch, shard_batch  # noqa: F401

MICRO, MAX_NORM = 2, 0.3


def train_step(model, batch, optimizer):
    rows = batch["tokens"].shape[0]
    total = 0.0
    for i in range(MICRO):
        part = {k: (v[i * rows // MICRO:(i + 1) * rows // MICRO] if hasattr(v, "shape") and v.dim() else v)
                for k, v in batch.items()}
        loss = loss_fn(model, part)
        loss.backward()
        total += float(loss)
        if not HEALTHY:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # the bug: inside the loop
    if HEALTHY:
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    return total
