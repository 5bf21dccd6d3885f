"""bandwidth on real gloo ranks: an injected slow rank is named; its healthy twin is silent."""

from __future__ import annotations

import pytest

from tests.harness import run_check

pytestmark = pytest.mark.timeout(120)

SMALL = 'sizes = ["4KiB", "256KiB"]\np2p_size = "256KiB"\n'


def _config(workdir, body: str):
    path = workdir / "bw.toml"
    path.write_text("[probes.bandwidth]\n" + body)
    return str(path)


def test_slow_rank_is_named_by_score_and_ring_and_fails_the_expected_busbw(workdir):
    """Rank 2 sleeps 30 ms before each call (far above a loaded box's noise): straggler + both ring links + busbw error name it."""
    cfg = _config(workdir, SMALL + 'delay_rank = 2\ndelay_s = 0.03\nexpected_busbw_gbps = {"256KiB" = {all_reduce = 50}}\n')
    result = run_check(4, ["--probes", "bandwidth", "--config", cfg], workdir, timeout=90, hosts=2)
    assert result.codes == [1] * 4, result.stderr
    probe = result.report().probe("bandwidth")
    warnings = [f for f in probe.findings if f.severity == "warning"]
    assert any("rank 2 (host" in f.issue and "straggler" in f.issue and f.ranks == [2] for f in warnings), probe.findings
    assert any("both its ring links are slow" in f.issue and f.ranks == [2] for f in warnings), probe.findings
    (err,) = [f for f in probe.findings if f.severity == "error"]
    assert err.ranks == [2] and "all_reduce at 256KiB" in err.issue and "suspects: rank 2" in err.issue


def test_healthy_twin_has_no_finding_above_info(workdir):
    """The same world with no delay, and an expected busbw the box meets (1 MB/s): every op and
    size measured, the floor checked, nothing named."""
    cfg = _config(workdir, SMALL + 'expected_busbw_gbps = {"256KiB" = {all_reduce = 0.001}}\n')
    result = run_check(4, ["--probes", "bandwidth", "--config", cfg], workdir, timeout=90, hosts=2)
    assert result.codes == [0] * 4, result.stderr
    report = result.report()
    assert report.findings("warning") == [], [f.issue for _, f in report.findings("warning")]
    probe = report.probe("bandwidth")
    assert {(r["op"], r["size"]) for r in probe.details["table:bandwidth"]} == {
        (op, s) for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast") for s in ("4KiB", "256KiB")
    }
    assert len(probe.details["table:ring links"]) == 4
    (row,) = [r for r in probe.details["table:bandwidth"] if r.get("expected_GBps")]
    assert (row["op"], row["size"]) == ("all_reduce", "256KiB")


def test_bandwidth_is_not_in_the_default_suite(workdir):
    """Without a profile or --probes naming it, the default plan leaves bandwidth out."""
    from distdiag.check.plan import make_plan, parse_config

    assert "bandwidth" not in make_plan(parse_config([]), 4).names
    assert "bandwidth" in make_plan(parse_config(["--probes", "env,bandwidth"]), 4).names


def test_a_rank_stuck_between_timed_calls_is_named_not_the_network(workdir):
    """Rank 1 sleeps 30 s before a timed call (timeout 3 s): the others wait inside the timed
    all_reduce loop; rank 1 is named as never having entered it, at its line in bandwidth.py,
    not an every-rank-inside stall blamed on the network."""
    cfg = _config(workdir, 'sizes = ["4KiB"]\nops = ["all_reduce"]\ndelay_rank = 1\ndelay_s = 30\np2p = false\n')
    result = run_check(3, ["--probes", "bandwidth", "--config", cfg, "--timeout-s", "3"], workdir, timeout=60)
    assert result.codes == [3, 3, 3], result.stderr
    report = result.report()
    (f,) = [f for _, f in report.findings("critical")]
    assert f.ranks == [1] and "never entered all_reduce" in f.issue, f.issue
    assert "bandwidth.py" in f.issue and "timed x" in f.issue, f.issue
    assert result.elapsed < 30, "the 30 s sleep must not be waited out"
