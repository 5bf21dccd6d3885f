"""Probes of the cluster a job runs on: is every rank's machine and network fit for it?

    env.py          software and environment that must agree across ranks
    collectives.py  every collective returns the right data on every group
    bandwidth.py    bus bandwidth per collective and size; slow links and ranks (opt-in)
    gpu.py          NVML health of each rank's GPU (skips without CUDA)

May import distdiag.probes.base, distdiag.report and distdiag.errors.
"""

__all__ = ["bandwidth", "collectives", "env", "gpu"]
