"""Bug: shard_batch slices rows [rank*n, rank*n + n + 1): an off-by-one gives rank 0 one row of rank 1's.

Report: "the 2-rank loss is higher than the 1-rank loss at step 1, and the ranks' losses differ".
Twin: rows [rank*n, (rank+1)*n).
"""

from _base import HEALTHY, build_model, loss_fn, make_batch, workload  # noqa: F401


def shard_batch(batch, rank, world_size):
    rows = batch["tokens"].shape[0]
    n = rows // world_size
    end = (rank + 1) * n if HEALTHY else min(rows, rank * n + n + 1)  # the bug: + 1
    shard = {k: v[rank * n:end] for k, v in batch.items()}
    shard["world_size"] = world_size
    shard["global_count"] = int(batch["mask"].sum())
    return shard
