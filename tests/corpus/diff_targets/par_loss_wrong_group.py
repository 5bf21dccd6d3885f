"""Bug: the loss is divided by the global token count but not multiplied by the world size.

FSDP2 averages gradients over the ranks, so a rank's loss must be its token-loss sum over the
global count TIMES the world size; without it every loss and gradient is 1/world of the
global batch's. Twin: the workload's loss (x world size).
"""

from _par_base import build_model, make_batch, shard_batch, token_loss_sum, workload  # noqa: F401
from _twin import HEALTHY


def loss_fn(model, batch):
    if HEALTHY:
        return workload.loss_fn(model, batch)
    return token_loss_sum(model, batch) / batch["global_count"]  # the bug: no x world_size
