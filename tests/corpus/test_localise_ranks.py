"""The module-by-module localiser on 2 real gloo ranks: a bug inside one module, and its fixed twin.

`distdiag.check --probes loss_parity --target tests/corpus/gen_targets/norm_eps_one_rank.py`: rank 1's
final LayerNorm has eps 0.1 (set in parallelize). The finding must name the module, the attribute,
the rank and the rerun that confirmed it; the twin (eps unchanged) must exit 0 with nothing above info,
and the localiser must not run on it at all (parity held).
"""

from __future__ import annotations

import pytest

from tests.corpus.generalisation import TARGETS
from tests.harness import run_check

pytestmark = pytest.mark.timeout(150)

TARGET = str(TARGETS / "norm_eps_one_rank.py")


def _run(workdir, healthy: bool):
    env = {"DISTDIAG_TWIN": "healthy"} if healthy else {}
    result = run_check(2, ["--probes", "loss_parity", "--target", TARGET], workdir, timeout=120, env=env)
    assert not result.timed_out, result.stderr
    return result, [f.to_dict() for f in result.report().probe("loss_parity").findings]


def test_the_module_attribute_and_rank_are_named_and_confirmed(workdir):
    _, findings = _run(workdir, healthy=False)
    [error] = [f for f in findings if f["severity"] == "error"]
    assert error["cause"] == "module_attribute_differs" and error["confidence"] >= 0.8
    text = error["issue"] + "\n" + error["evidence"]
    assert "norm is configured differently on rank 1: eps 0.1 (reference 1e-05)" in text
    assert "the first to differ is norm on rank 1" in text
    assert "confirmed by rerun: rerun with the reference's eps=1e-05, norm computes the reference's output" in text
    assert "on rank 0 every module computes the reference's output from the same inputs" in text


def test_the_twin_is_quiet(workdir):
    result, findings = _run(workdir, healthy=True)
    assert result.codes == [0, 0], result.stderr
    assert [f for f in findings if f["severity"] != "info"] == []
    assert not any("module by module" in (f.get("evidence") or "") for f in findings)
