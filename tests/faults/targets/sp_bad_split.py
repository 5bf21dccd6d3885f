"""Bad input: split_sequence returns float input_ids of the wrong width, and refuses uneven lengths."""

import torch


def split_sequence(batch, rank, world_size):
    seq = batch["input_ids"].shape[1]
    if seq % world_size:
        raise ValueError(f"sequence length {seq} must divide by {world_size}")
    return {"input_ids": torch.zeros(batch["input_ids"].shape[0], 3), "shift_labels": batch["labels"][:, :3]}
