"""Bug: each rank returns the mean over its own valid tokens (per-rank mean, averaged over ranks)."""

import torch.nn.functional as F
from sp_healthy import build_model, make_batch, parallelize_sp, split_sequence  # noqa: F401

from distdiag.workloads.sequence import shift_labels


def loss_fn(model, batch):
    logits = model(batch["input_ids"], batch.get("position_ids"), batch.get("attention_mask"))
    targets = batch["shift_labels"] if "shift_labels" in batch else shift_labels(batch["labels"])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)  # the bug
