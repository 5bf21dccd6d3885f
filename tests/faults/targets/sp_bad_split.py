"""Bad input: split_sequence returns float input_ids of the wrong width."""

import torch


def split_sequence(batch, rank, world_size):
    return {"input_ids": torch.zeros(batch["input_ids"].shape[0], 3), "shift_labels": batch["labels"][:, :3]}
