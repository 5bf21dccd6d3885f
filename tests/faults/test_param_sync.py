"""param_sync on real gloo ranks: a buffer initialised per rank, and a norm whose gradient is
never all-reduced (kept out of FSDP with ignored_params); each with its healthy twin."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import run_check

pytestmark = pytest.mark.timeout(150)

TARGETS = Path(__file__).resolve().parent / "targets"


def _run(workdir, target: str, probes: str, *, healthy: bool = False, world: int = 2):
    env = {"DISTDIAG_TWIN": "healthy"} if healthy else {}
    return run_check(world, ["--probes", probes, "--target", str(TARGETS / f"{target}.py")], workdir, timeout=120, env=env)


def test_buffer_initialised_per_rank_is_named_at_setup(workdir):
    """scale = 1 + 0.25*rank: the buffer differs right after setup; determinism says the inputs differ, not SDC."""
    result = _run(workdir, "rank_buffer", "param_sync,determinism", world=3)
    assert result.codes == [1, 1, 1], result.stderr
    report = result.report()
    (err,) = [f for f in report.probe("param_sync").findings if f.severity == "error"]
    assert err.issue.startswith("buffer scale differs across ranks (already at setup)")
    assert "rank-dependent init" in err.fix
    det = [f.issue for f in report.probe("determinism").findings if f.severity == "error"]
    assert any("build_model or make_batch gives different bits" in i for i in det), det
    assert not any("silent-data-corruption" in i for i in det), det


def test_norm_gradient_never_reduced_is_named_with_first_step(workdir):
    """norm.weight/bias in ignored_params: they drift from step 1, fsdp_plan and loss_parity name the norm."""
    result = _run(workdir, "unreduced_norm", "fsdp_plan,loss_parity,param_sync")
    assert result.codes == [1, 1], result.stderr
    report = result.report()
    (err,) = [f for f in report.probe("param_sync").findings if f.severity == "error"]
    assert "norm.bias, norm.weight differ across ranks (first after step 1)" in err.issue
    assert "never reduced" in err.fix
    (plan,) = [f for f in report.probe("fsdp_plan").findings if f.severity == "error"]
    assert "not managed by any FSDP group, in module(s) norm" in plan.issue
    (parity,) = [f for f in report.probe("loss_parity").findings if f.severity == "error"]
    assert "largest error in module norm" in parity.issue and parity.cause == "unmanaged_params"


@pytest.mark.parametrize("target", ["rank_buffer", "unreduced_norm"])
def test_healthy_twins_pass(workdir, target):
    """The same targets without their bug, at the fault run's world size: no finding above info."""
    world = 3 if target == "rank_buffer" else 2
    result = _run(workdir, target, "fsdp_plan,loss_parity,param_sync,determinism", healthy=True, world=world)
    assert result.codes == [0] * world, result.stdout + result.stderr
    assert result.report().findings("warning") == []


def test_hsdp_replicas_never_reduced_drift(workdir):
    """HSDP meant, the shard sub-mesh given to fully_shard: the copies of each shard drift from step 1."""
    result = _run(workdir, "hsdp_replicas", "param_sync", world=4)
    assert result.codes == [1] * 4, result.stderr
    errors = [f for f in result.report().probe("param_sync").findings if f.severity == "error"]
    assert errors and all(f.issue.startswith("sub-mesh shard replicas ") for f in errors), errors
    assert all("first after step 1" in f.issue for f in errors)
    assert any("[shard shard=0]" in f.issue for f in errors) and "2-D mesh" in errors[0].fix


def test_hsdp_healthy_twin_passes_parity_and_sync(workdir):
    """The same HSDP setup with the replica all-reduce on: parity with the reference and replicas equal."""
    result = _run(workdir, "hsdp_replicas", "fsdp_plan,loss_parity,param_sync", world=4, healthy=True)
    assert result.codes == [0] * 4, result.stdout + result.stderr
    report = result.report()
    assert report.findings("warning") == []
    assert report.probe("param_sync").metrics["replicated_tensors"] > 20
    rows = report.probe("fsdp_plan").details["table:fsdp plan"]
    assert rows[0]["placements"] == "R, S(0)"


def test_rng_out_of_step_is_a_warning_and_its_twin_is_quiet(workdir):
    """Rank 1 of 3 draws 4 extra random numbers in build_model: its RNG state is named; the twin is quiet."""
    result = _run(workdir, "rng_drift", "param_sync", world=3)
    assert result.codes == [0, 0, 0], result.stderr
    (warn,) = [f for f in result.report().probe("param_sync").findings if f.severity == "warning"]
    assert warn.ranks == [1] and "CPU RNG state differs across ranks right after setup" in warn.issue
    twin = _run(workdir / "twin", "rng_drift", "param_sync", world=3, healthy=True)
    assert twin.codes == [0, 0, 0] and twin.report().findings("warning") == []


def test_rng_out_of_step_is_named_the_same_when_the_numerics_probes_share_the_model(workdir):
    """All four numerics probes on one shared model: param_sync's setup checksums are still taken right after
    setup (before loss_parity builds its reference), so rank 1's extra draws are named as alone."""
    result = _run(workdir, "rng_drift", "fsdp_plan,loss_parity,param_sync,determinism", world=3)
    assert result.codes == [0, 0, 0], result.stderr
    (warn,) = [f for f in result.report().probe("param_sync").findings if f.severity == "warning"]
    assert warn.ranks == [1] and "CPU RNG state differs across ranks right after setup" in warn.issue
    assert result.report().probe("param_sync").metrics["steps"] == 2


@pytest.mark.parametrize("world", [2, 3])
def test_a_teacher_updated_on_one_rank_is_an_update_outside_the_optimizer(workdir, world):
    """An EMA teacher (requires_grad=False) updated on rank 0 only: it drifts from step 1, and
    with no gradient of its own no reduction could have kept it in step. The cause says so; the
    fix is about the update, not about reducing gradients."""
    result = _run(workdir, "ema_teacher", "param_sync", world=world)
    assert result.codes == [1] * world, result.stderr
    (err,) = [f for f in result.report().probe("param_sync").findings if f.severity == "error"]
    assert err.cause == "updated_outside_optimizer_per_rank", err
    assert err.issue.startswith("frozen params teacher.0.bias, teacher.0.weight, teacher.2.bias, teacher.2.weight differ")
    assert "(first after step 1)" in err.issue and "requires_grad=False" in err.fix and "reduced" not in err.fix.split(":")[0]
    if world == 3:
        assert err.ranks == [0], err.ranks  # the one rank that moved its teacher


def test_a_teacher_updated_on_every_rank_passes(workdir):
    result = _run(workdir, "ema_teacher", "param_sync,loss_parity", healthy=True, world=2)
    assert result.codes == [0, 0], result.stdout + result.stderr
    assert result.report().findings("warning") == []
