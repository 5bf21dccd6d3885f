"""Bug: the target's own batches have a length the world does not divide (33), and the split
floors the shard size, so the last position of every row is on no rank.

Healthy twin (DISTDIAG_TWIN=healthy): the batches are 32 long. The split is the same and
still relies on the length dividing by the world size (an invariant its collator keeps), so
only the probe's made-up length 33 loses a token: a warning naming that invariant, not an error.
"""

import torch
from _twin import HEALTHY
from sp_healthy import build_model, loss_fn, parallelize_sp  # noqa: F401

from distdiag.workloads.sequence import make_lm_batch, shift_labels

SEQ = 32 if HEALTHY else 33


def make_batch(step):
    return make_lm_batch(1, SEQ, 64, pad=5, seed=step)


def split_sequence(batch, rank, world_size):
    seq = batch["input_ids"].shape[1]
    per = seq // world_size  # relies on seq % world_size == 0: the remainder is dropped
    sl = slice(rank * per, (rank + 1) * per)
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(seq).expand_as(batch["input_ids"])
    out = {
        "input_ids": batch["input_ids"][:, sl],
        "shift_labels": shift_labels(batch["labels"])[:, sl],
        "position_ids": positions[:, sl],
    }
    if batch.get("attention_mask") is not None:
        out["attention_mask"] = batch["attention_mask"][:, sl]
    return out
