"""Probes of the numbers a sharded model computes: 1 rank vs N, FSDP2's plan, replicas.

    fsdp_plan.py      parameters FSDP2 left unsharded, mixed precision, reshard settings
    loss_parity.py    the loss and gradients of N ranks against one rank's reference
    param_sync.py     replicas that drifted apart after optimizer steps
    determinism.py    the same step run twice gives the same numbers
    shared.py         ParallelRun: one sharded model and its trajectory, shared by the four
    parity_report.py  loss_parity's findings and table from the ranks' payloads
    localise.py       after a parity failure: the first module whose own computation differs, and reruns
    localise_shape.py the shape of a module's difference (a factor, dropout, a dtype, an order, rows)
    localise_read.py  those records across ranks: a mechanism only where a rerun confirmed it
    replicas.py       checksums of what must be equal across ranks (param_sync, determinism)
    setup_sync.py     the model as built, before parallelize: equal on every rank, dtypes, devices
    setup_digest.py   setup_sync's per-tensor digests and the mechanism their differences name
    setup_after.py    whether a difference seen as built reaches the parallel model
    setup_findings.py setup_sync's findings on the digests (divergence, dtype and shape)
    setup_placement.py  devices, master-weight and loss precision, mixed precision across ranks

May import distdiag.probes.base, distdiag.probes.training (building, sharding and stepping
the model, shared with the sequence_parallel and moe probes), distdiag.workloads, distdiag.report and distdiag.errors.
"""

__all__ = [
    "determinism", "fsdp_plan", "localise", "localise_read", "localise_shape", "loss_parity", "param_sync", "parity_report", "replicas", "setup_after",
    "setup_digest", "setup_findings", "setup_placement", "setup_sync", "shared",
]
