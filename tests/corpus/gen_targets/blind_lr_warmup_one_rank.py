"""Bug: the warmup scheduler's step count is restored from the resume state on rank 0 only; rank 1 restarts warmup at step 0.

Report: "after resuming, rank 1's updates are 10x smaller than rank 0's; the parameters drift apart".
Twin: every rank resumes the scheduler at the same step.
"""

from _base import HEALTHY, RANK, build_model, loss_fn, make_batch, shard_batch  # noqa: F401

WARMUP, BASE_LR = 10, 0.05
RESUMED_AT = {0: 10, 1: 0}  # rank 1's scheduler state was never loaded


def train_step(model, batch, optimizer):
    n = getattr(optimizer, "_sched_step", RESUMED_AT[0] if HEALTHY else RESUMED_AT[RANK % 2])
    for group in optimizer.param_groups:
        group["lr"] = BASE_LR * min(1.0, (n + 1) / WARMUP)
    loss = loss_fn(model, batch)
    loss.backward()
    optimizer.step()
    optimizer._sched_step = n + 1
    return loss
