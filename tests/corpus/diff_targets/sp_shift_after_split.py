"""Bug: labels shifted per shard after the split: the target of each shard's last token is lost.

Twin: shift over the whole sequence before the split (the built-in contiguous split).
"""

from _sp_base import build_model, loss_fn, make_batch, parallelize_sp  # noqa: F401
from _sp_base import split_sequence as healthy_split
from _twin import HEALTHY

from distdiag.workloads.sequence import contiguous_indices, shift_labels


def split_sequence(batch, rank, world_size):
    if HEALTHY:
        return healthy_split(batch, rank, world_size)
    index = contiguous_indices(batch["input_ids"].shape[1], rank, world_size)
    out = {k: v[:, index] for k, v in batch.items() if k != "labels"}
    out["shift_labels"] = shift_labels(batch["labels"][:, index])  # the bug: shifted within the shard
    out["position_ids"] = index.expand(batch["input_ids"].shape[0], -1)
    return out
