"""Bug: the SP attention gathers key/value shards along dim 0 (batch) instead of dim 1 (sequence)."""

from sp_healthy import build_model, loss_fn, make_batch, split_sequence  # noqa: F401

from distdiag.workloads.sequence import parallelize_tiny_lm


def parallelize_sp(model, mesh):
    model = parallelize_tiny_lm(model, mesh)
    model.gather_dim = 0  # the bug
    return model
