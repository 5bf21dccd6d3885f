"""Probes of the numbers a sharded model computes: 1 rank vs N, FSDP2's plan, replicas.

    fsdp_plan.py      parameters FSDP2 left unsharded, mixed precision, reshard settings
    loss_parity.py    the loss and gradients of N ranks against one rank's reference
    param_sync.py     replicas that drifted apart after optimizer steps
    determinism.py    the same step run twice gives the same numbers
    shared.py         ParallelRun: one sharded model and its trajectory, shared by the four
    parity_report.py  loss_parity's findings and table from the ranks' payloads

May import distdiag.probes.base, distdiag.probes.training (building, sharding and stepping
the model, shared with the sequence_parallel and moe probes), distdiag.workloads, distdiag.report and distdiag.errors.
"""

__all__ = ["determinism", "fsdp_plan", "loss_parity", "param_sync", "parity_report", "shared"]
