"""A fast subset of the generalisation cases (tests/corpus/gen_targets) as a regression guard.

Bugs the first diagnosis rules were not written for, run on 2 real gloo ranks through
`distdiag.check --target FILE --probes P` (tests/harness.py, hard timeout): each must be named by a
cause of its mechanism, with no other cause at high confidence; its twin must stay quiet. The full
set, with the held-out cases and the calibration table, is tests/corpus/run_generalisation.py.
"""

from __future__ import annotations

import pytest

from tests.corpus.generalisation import CASES, TARGETS, classify_bug, twin_loud
from tests.harness import run_check

pytestmark = pytest.mark.timeout(150)

GUARD = ["label_smoothing_one_rank", "shard_rows_off_by_one", "uneven_batch_count", "eval_mode_one_rank"]
_CASES = {c.target: c for c in CASES}


def _findings(workdir, case, healthy: bool):
    env = {"DISTDIAG_TWIN": "healthy"} if healthy else {}
    result = run_check(case.world, ["--probes", case.probes, "--target", str(TARGETS / f"{case.target}.py")], workdir,
                       timeout=120, env=env)
    assert not result.timed_out, result.stderr
    report = result.report()
    return result, [f.to_dict() for p in case.probes.split(",") for f in report.probe(p).findings]


@pytest.mark.parametrize("name", GUARD)
def test_bug_is_named_without_a_wrong_confident_cause(workdir, name):
    """The bug: a finding with its mechanism's cause, and no other cause at confidence >= 0.8."""
    case = _CASES[name]
    _, findings = _findings(workdir, case, healthy=False)
    got = classify_bug(case, findings)
    assert got["outcome"] == "named" and got["located"], got["causes"]
    assert got["wrong_high"] == [], got["wrong_high"]


@pytest.mark.parametrize("name", GUARD)
def test_twin_is_quiet(workdir, name):
    """The fixed twin: exit 0 and nothing above info from the probes it ran."""
    case = _CASES[name]
    result, findings = _findings(workdir, case, healthy=True)
    assert result.codes == [0] * case.world, result.stderr
    assert twin_loud(findings) == []
