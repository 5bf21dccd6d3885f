"""Differential diagnosis of a parity failure: which mechanism the evidence supports.

loss_parity knows, at the first step where the parallel run leaves the 1-process reference:
the loss of each rank and the reference's, every tensor's relative error and its best
scale factor against the reference (``factor``, with ``resid`` what is left once that factor
is taken out), each rank's factor over all its gradients, and whether the weights already
differed before step 1. Each rule below reads one pattern of that evidence and names the
mechanism (``cause``), the observations that decided it, a fix for that mechanism only, and
a confidence that says how well the evidence separates it from the alternatives
(docs/numerics.md#differential-diagnosis gives the thresholds and why).

A rule never advises what the evidence shows the code already does right: an exact loss
means the loss normalisation is right, so no rule that fires on one talks about the loss.
"""

from __future__ import annotations

from distdiag.probes.numerics import diagnose_rules as rules
from distdiag.probes.numerics.parity_evidence import Diagnosis, ParityEvidence, groups_making, ratio_to_integer

__all__ = ["Diagnosis", "ParityEvidence", "diagnose_parity", "groups_making", "ratio_to_integer"]


def diagnose_parity(ev: ParityEvidence) -> Diagnosis:
    """The mechanism the evidence supports best, tried from the most to the least specific."""
    for rule in rules.RULES:
        found = rule(ev)
        if found is not None:
            return found
    return rules.unexplained(ev)
