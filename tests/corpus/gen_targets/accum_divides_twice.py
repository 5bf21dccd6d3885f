"""Bug: gradient accumulation divides each micro-batch's loss by the micro-step count, but the loss is already normalised by the global token count.

Report: "with grad accumulation 2 the effective learning rate is halved; without accumulation it trains as expected".
Twin: the micro-batch losses (each already over the global count) are summed, not divided again.
"""

from _base import HEALTHY, build_model, loss_fn, make_batch, shard_batch  # noqa: F401

MICRO = 2


def train_step(model, batch, optimizer):
    rows = batch["tokens"].shape[0]
    total = 0.0
    for i in range(MICRO):
        part = {k: (v[i * rows // MICRO:(i + 1) * rows // MICRO] if hasattr(v, "shape") and v.dim() else v)
                for k, v in batch.items()}
        loss = loss_fn(model, part)
        if not HEALTHY:
            loss = loss / MICRO  # the bug: loss_fn already divides by the global count
        loss.backward()
        total += float(loss)
    optimizer.step()
    return total
