"""Bug: every shard's position ids restart at 0."""

import torch
from sp_healthy import build_model, loss_fn, make_batch, parallelize_sp  # noqa: F401

from distdiag.workloads.sequence import contiguous_split


def split_sequence(batch, rank, world_size):
    local = contiguous_split(batch, rank, world_size)
    local["position_ids"] = torch.arange(local["input_ids"].shape[1]).expand_as(local["input_ids"])  # the bug
    return local
