"""Bug: the position table is frozen by a flag only rank 1's launcher sets (requires_grad False on one rank).

Report: "with --freeze-pos on one node the run does not hang, but the loss drifts from the reference".
Twin: the flag on every rank (pos frozen everywhere).
"""

from _base import HEALTHY, RANK, loss_fn, make_batch, shard_batch, workload  # noqa: F401


def build_model():
    model = workload.build_model()
    if HEALTHY or RANK == 1:
        model.pos.requires_grad_(False)
    return model
