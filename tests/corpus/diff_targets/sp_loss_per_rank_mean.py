"""Bug: each SP rank returns the mean over its own valid tokens (ranks hold different counts).

Twin: token-loss sum x world / the group's valid targets (an all_reduce of counts).
"""

import torch.nn.functional as F
from _sp_base import build_model, make_batch, parallelize_sp, split_sequence  # noqa: F401
from _sp_base import loss_fn as healthy_loss
from _twin import HEALTHY

from distdiag.workloads.sequence import shift_labels


def loss_fn(model, batch):
    if HEALTHY:
        return healthy_loss(model, batch)
    logits = model(batch["input_ids"], batch.get("position_ids"), batch.get("attention_mask"))
    targets = batch["shift_labels"] if "shift_labels" in batch else shift_labels(batch["labels"])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)  # the bug
