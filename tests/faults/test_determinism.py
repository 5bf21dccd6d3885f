"""determinism on real gloo ranks. On a CPU at one thread every kernel is deterministic, so
these tests INJECT the nondeterminism: an unseeded generator in the loss (the step is not
reproducible), and a rank that computes slightly different bits (a silent-data-corruption
suspect). Each with its healthy twin."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import run_check

pytestmark = pytest.mark.timeout(150)

TARGETS = Path(__file__).resolve().parent / "targets"


def _run(workdir, target: str, *, healthy: bool = False, world: int = 2, env: dict | None = None, probes: str = "determinism"):
    env = dict(env or {})
    if healthy:
        env["DISTDIAG_TWIN"] = "healthy"
    args = ["--probes", probes, "--target", str(TARGETS / f"{target}.py")]
    return run_check(world, args, workdir, timeout=120, env=env)


def test_injected_nondeterministic_op_is_named(workdir):
    """Injected: the loss draws from an os.urandom-seeded generator; the repeated step differs bitwise."""
    result = _run(workdir, "nondeterministic")
    assert result.codes == [1, 1], result.stderr
    issues = [f.issue for f in result.report().probe("determinism").findings if f.severity == "error"]
    assert any(i.startswith("the reference forward/backward is not reproducible on ranks 0-1") for i in issues), issues
    assert any(i.startswith("the parallel step is not reproducible") for i in issues), issues


def test_injected_rank_with_different_bits_is_an_sdc_suspect(workdir):
    """Injected: rank 2 of 3 scales its loss by 1+1e-7; it alone is named as an SDC suspect."""
    result = _run(workdir, "sdc_rank", world=3, env={"DISTDIAG_SDC_RANK": "2"})
    assert result.codes == [1, 1, 1], result.stderr
    (err,) = [f for f in result.report().probe("determinism").findings if f.severity == "error"]
    assert err.ranks == [2] and "silent-data-corruption suspect" in err.issue
    assert "rank 2 (host" in err.evidence


@pytest.mark.parametrize("target", ["nondeterministic", "sdc_rank"])
def test_healthy_twins_are_bitwise_reproducible(workdir, target):
    """Without the injection: reproducible on every rank and the same bits everywhere."""
    result = _run(workdir, target, healthy=True, world=3 if target == "sdc_rank" else 2, env={"DISTDIAG_SDC_RANK": "2"})
    assert result.codes == [0] * len(result.codes), result.stdout + result.stderr
    assert result.report().findings("warning") == []


def test_the_repeat_of_a_step_another_probe_ran_is_still_compared(workdir):
    """With loss_parity first, the parallel model and its step 1 are shared: determinism repeats only that step,
    and the injected nondeterminism is still named (the twin still passes)."""
    result = _run(workdir, "nondeterministic", probes="loss_parity,determinism")
    assert result.codes == [1, 1], result.stderr
    issues = [f.issue for f in result.report().probe("determinism").findings if f.severity == "error"]
    assert any(i.startswith("the parallel step is not reproducible") for i in issues), issues
    twin = _run(workdir / "twin", "nondeterministic", healthy=True, probes="fsdp_plan,loss_parity,param_sync,determinism")
    assert twin.codes == [0, 0], twin.stdout + twin.stderr
    assert twin.report().findings("warning") == []
