"""Bug: labels split first and shifted per shard: each shard loses its last target."""

from sp_healthy import build_model, loss_fn, make_batch, parallelize_sp  # noqa: F401

from distdiag.workloads.sequence import contiguous_indices, shift_labels


def split_sequence(batch, rank, world_size):
    idx = contiguous_indices(batch["input_ids"].shape[1], rank, world_size)
    local = {k: v[:, idx] for k, v in batch.items()}
    local["position_ids"] = idx.expand_as(local["input_ids"])
    local["shift_labels"] = shift_labels(local.pop("labels"))  # the bug: shifted after the split
    return local
