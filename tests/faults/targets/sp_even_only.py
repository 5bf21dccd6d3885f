"""Healthy split that refuses (with a clear error) sequence lengths the world size does not divide."""

from distdiag.workloads.sequence import contiguous_split


def split_sequence(batch, rank, world_size):
    seq = batch["input_ids"].shape[1]
    if seq % world_size:
        raise ValueError(f"sequence length {seq} must divide by {world_size}")
    return contiguous_split(batch, rank, world_size)
