"""The fault-injection vocabulary parses, and refuses what it cannot read."""

from __future__ import annotations

import pytest

from distdiag.errors import ConfigError
from distdiag.runtime.faults import FaultPlan


def test_parse_selects_this_rank():
    plan = FaultPlan.parse("hang:collectives:1; skip:env:0:after=3; sleep:final:1:seconds=2.5", rank=1)
    assert [(f.action, f.point, f.after) for f in plan.faults] == [("hang", "collectives", 0), ("sleep", "final", 0)]
    assert plan.faults[1].seconds == 2.5


def test_collective_faults_default_to_first_collective():
    plan = FaultPlan.parse("corrupt:collectives:0", rank=0)
    assert plan.collective_fault("collectives", 1) == "corrupt"
    assert plan.collective_fault("collectives", 1) is None  # fires once


@pytest.mark.parametrize("spec", ["explode:env:0", "hang:env", "hang:env:x", "sleep:env:0:when=3"])
def test_bad_specs(spec):
    with pytest.raises(ConfigError, match="DISTDIAG_INJECT"):
        FaultPlan.parse(spec)
