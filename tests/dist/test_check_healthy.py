"""Healthy runs of the real check (forked ranks, gloo, real store): pass, no false positives."""

from __future__ import annotations

import json

import pytest

from distdiag.report.model import read_report
from tests.harness import run_check

pytestmark = pytest.mark.timeout(120)


def _no_finding_above_info(report):
    return [(name, f.severity, f.issue) for name, f in report.findings("warning")]


@pytest.mark.parametrize("world", [2, 4])
def test_healthy_world_passes_with_nothing_above_info(workdir, world):
    """A healthy box: exit 0 on every rank, no finding above info, a rank table, rank 0 prints alone."""
    result = run_check(world, ["--probes", "env,collectives"], workdir, timeout=60)
    assert result.codes == [0] * world, result.stderr
    report = result.report()
    assert report.exit_code == 0 and report.verdict == "pass"
    assert _no_finding_above_info(report) == []
    assert [r.rank for r in report.ranks] == list(range(world))
    assert all(r.pid > 0 and r.device == "cpu" for r in report.ranks)
    assert "verdict: PASS (exit 0)" in result.outcomes[0].stdout
    for outcome in result.outcomes[1:]:
        assert len(outcome.stdout.splitlines()) <= 1, outcome.stdout
    assert report.probe("collectives").metrics["checks"] > 0


@pytest.mark.parametrize(
    "world,limits",
    [(3, ["--timeout-s", "3"]), (2, ["--timeout-s", "30", "--deadline-s", "20"])],
    ids=["probe-timeout-3s-world-3", "whole-check-deadline"],
)
def test_the_failure_paths_limits_stay_quiet_on_a_healthy_run(workdir, world, limits):
    """The healthy twin of the failure-path tests: the same short --timeout-s at world 3, and a
    --deadline-s the healthy check fits in, end in a pass with nothing above info."""
    result = run_check(world, ["--probes", "env,collectives", *limits], workdir, timeout=60)
    assert result.codes == [0] * world, result.stderr
    report = result.report()
    assert report.outcome == "completed" and report.verdict == "pass"
    assert _no_finding_above_info(report) == []


def test_report_on_disk_reads_back_equal_and_matches_json_output(workdir):
    """--format json prints the report on stdout; the file written reads back equal."""
    result = run_check(2, ["--probes", "env,collectives", "--format", "json", "--report", "out/r.json"], workdir, timeout=60)
    assert result.codes == [0, 0], result.stderr
    on_disk = read_report(workdir / "out" / "r.json")
    printed = json.loads(result.outcomes[0].stdout)
    assert printed == on_disk.to_dict()
    assert result.outcomes[1].stdout == ""


def test_world_of_one_skips_collectives(workdir):
    """By default a probe that cannot use a world of 1 is skipped with the reason, not an error."""
    result = run_check(1, [], workdir, timeout=60)
    assert result.codes == [0], result.stderr
    report = result.report()
    assert report.probe("collectives").status == "skip"
    assert "WORLD_SIZE must be >= 2" in report.probe("collectives").reason


def test_pretend_two_nodes_every_node_gets_the_report(workdir):
    """Ranks split over two pretend nodes: the rank table carries node and local rank."""
    result = run_check(4, ["--probes", "env,collectives"], workdir, timeout=60, hosts=2)
    assert result.codes == [0] * 4, result.stderr
    report = result.report()
    assert [(r.node, r.local_rank) for r in report.ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
