"""The data_shards probe: do the ranks see different data?

    probe.py        the probe: fingerprints of each rank's first batches, compared across ranks
    fingerprint.py  row hashes of a batch, and the comparison (identical, overlapping, repeated)

May import distdiag.probes.base, distdiag.probes.training, distdiag.report and distdiag.errors.
"""

__all__ = ["fingerprint", "probe"]
