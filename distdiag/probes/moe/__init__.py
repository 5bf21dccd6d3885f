"""The moe_routing probe: is the MoE router deterministic and the dispatch consistent?

    probe.py     the probe: routes the same tokens twice and across ranks, runs the dispatch
    checks.py    the router analysed: non-determinism, dropped tokens, load imbalance
    dispatch.py  the all_to_all dispatch checked against the router's plan

May import distdiag.probes.base, distdiag.workloads, distdiag.report and distdiag.errors.
"""

__all__ = ["checks", "dispatch", "probe"]
