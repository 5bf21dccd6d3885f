"""Bug: a floor split (seq // world per rank) on 33-long sequences: position 32 is on no rank.

Twin: the fix the probe gives: the collator pads sequences to a multiple of the world size
(34 here) and the split refuses any other length instead of dropping tokens. (A remainder
split such as torch.tensor_split would keep every token, but the tiny LM's sequence gather
needs equal shards.)
"""

import torch
from _sp_base import build_model, loss_fn, parallelize_sp  # noqa: F401
from _twin import HEALTHY

from distdiag.workloads.sequence import make_lm_batch, take_positions


def make_batch(step):
    return make_lm_batch(2, 34 if HEALTHY else 33, 64, pad=5, seed=step)


def split_sequence(batch, rank, world_size):
    seq = batch["input_ids"].shape[1]
    if HEALTHY and seq % world_size:
        raise ValueError(f"sequence length {seq} is not a multiple of the SP world size {world_size}; pad in the collator")
    per = seq // world_size  # the bug where seq % world_size != 0: the remainder is dropped
    return take_positions(batch, torch.arange(rank * per, (rank + 1) * per))
