"""The checkpoint probe: does a DCP save/load round trip give back every key, shape and value?

    probe.py      the probe: saves and loads through torch.distributed.checkpoint
    keys.py       the keys compared: missing, unexpected, reshaped
    findings.py   the findings and their table from the ranks' payloads
    safe_load.py  reading DCP metadata without running code from the directory (no pickle)

May import distdiag.probes.base, distdiag.workloads, distdiag.report and distdiag.errors.
"""

__all__ = ["findings", "keys", "probe", "safe_load"]
