"""Bug: the loss is normalised by this rank's valid-token count (ranks hold different counts).

Twin: divided by the global count, times the world size (the workload's loss).
"""

from _par_base import build_model, make_batch, shard_batch, token_loss_sum, workload  # noqa: F401
from _twin import HEALTHY


def loss_fn(model, batch):
    if HEALTHY:
        return workload.loss_fn(model, batch)
    return token_loss_sum(model, batch) / batch["mask"].sum()  # the bug: this rank's count
