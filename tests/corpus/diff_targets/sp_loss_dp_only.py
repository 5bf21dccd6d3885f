"""Bug: the SP loss is scaled for the data-parallel group only (x dp), not for dp x sp.

Gradients are averaged over every dp x sp rank, so a rank's loss must be its token-loss sum
x (dp x sp) / the group's valid targets. Scaled by dp (1 here: the whole world is one SP
group) it comes out exactly 1/sp. Twin: x dp x sp (distdiag.workloads.sequence.sp_loss).
"""

import torch.distributed as dist
import torch.nn.functional as F
from _sp_base import build_model, make_batch, parallelize_sp, split_sequence  # noqa: F401
from _sp_base import loss_fn as healthy_loss
from _twin import HEALTHY

from distdiag.workloads.sequence import shift_labels

DP = 1  # data-parallel replicas in this run; the SP group is the whole world


def loss_fn(model, batch):
    if HEALTHY:
        return healthy_loss(model, batch)
    logits = model(batch["input_ids"], batch.get("position_ids"), batch.get("attention_mask"))
    targets = batch["shift_labels"] if "shift_labels" in batch else shift_labels(batch["labels"])
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum")
    count = (targets != -100).sum().float()
    if "shift_labels" in batch and dist.is_initialized():
        dist.all_reduce(count)  # the whole group's valid targets: right
        return total * DP / count.clamp(min=1)  # the bug: x dp, not x dp x sp
    return total / count.clamp(min=1)
