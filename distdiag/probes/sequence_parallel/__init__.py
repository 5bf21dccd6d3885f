"""The sequence_parallel probe: does the user's sequence split lose, duplicate or shift tokens?

    probe.py       the probe: calls the split on every rank, gathers what each rank holds
    checks.py      the split analysed: lost, duplicated, reordered tokens, shifted labels
    end_to_end.py  a sharded forward/backward against the unsplit one

May import distdiag.probes.base, distdiag.workloads, distdiag.report and distdiag.errors.
"""

__all__ = ["checks", "end_to_end", "probe"]
