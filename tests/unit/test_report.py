"""The report contract: round trip, atomic writes, exit-code precedence, clear read errors."""

from __future__ import annotations

import json
import os

import pytest

from distdiag.errors import ReportError
from distdiag.render import format_ranks, render_report
from distdiag.report import (
    SCHEMA,
    Finding,
    ProbeResult,
    RankInfo,
    Report,
    exit_code_for,
    read_report,
    write_report,
)


def _report() -> Report:
    return Report(
        world_size=4,
        probes=[
            ProbeResult.from_findings(
                "collectives",
                [Finding("error", "all_reduce wrong on rank 2", "got 4, expected 3", [2], "check NIC", 0.9)],
                metrics={"checks": 10},
                duration_s=0.5,
                details={"table:x": [{"a": 1, "b": "two"}]},
            ),
            ProbeResult("env", status="pass"),
            ProbeResult("gpu", status="skip", reason="no NVML"),
        ],
        ranks=[RankInfo(r, "h", 0, r, "cpu", 100 + r) for r in range(4)],
        exit_code=1,
        verdict="fail",
        summary="collectives failed",
        not_run=["checkpoint"],
        restart_count=1,
    )


def test_round_trip_equal(tmp_path):
    """A written report reads back equal, field for field."""
    report = _report()
    path = write_report(report, tmp_path / "r.json")
    back = read_report(path)
    assert back == report
    assert json.loads(path.read_text())["schema"] == SCHEMA


def test_write_is_atomic_and_leaves_no_temp(tmp_path):
    """The write goes through a temp file and rename: no partial file, no leftovers."""
    target = tmp_path / "sub" / "r.json"
    write_report(_report(), target)
    write_report(_report(), target)
    assert sorted(os.listdir(target.parent)) == ["r.json"]


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("{not json", "not valid JSON"),
        ('{"schema": "other/1"}', "not a distdiag report"),
        ('{"schema": "distdiag.report/9", "world_size": 1}', "not supported"),
        ("[1, 2]", "JSON list"),
        ('{"schema": "distdiag.report/1"}', "not a valid distdiag report"),
    ],
)
def test_bad_files_raise_one_line(tmp_path, content, words):
    """Truncated, foreign or future reports give a ReportError naming the problem."""
    path = tmp_path / "r.json"
    path.write_text(content)
    with pytest.raises(ReportError, match=words) as info:
        read_report(path)
    assert "\n" not in str(info.value)


def test_missing_file():
    """A missing report is a ReportError, not FileNotFoundError."""
    with pytest.raises(ReportError, match="no report at"):
        read_report("/nonexistent/r.json")


def test_exit_code_precedence():
    """2 alone; then 3 over 4 over 1 over 0."""
    fail = ProbeResult("a", status="fail")
    drain = ProbeResult.from_findings("b", [Finding("error", "x", drain={"host": "h", "device": "cuda:1"})])
    crit = ProbeResult.from_findings("c", [Finding("critical", "hung")])
    assert exit_code_for([fail, drain, crit], bad_input=True) == 2
    assert exit_code_for([fail, drain, crit]) == 3
    assert exit_code_for([fail, drain]) == 4
    assert exit_code_for([fail]) == 1
    assert exit_code_for([ProbeResult("ok")]) == 0
    assert exit_code_for([ProbeResult.from_findings("w", [Finding("warning", "w")])]) == 0
    assert exit_code_for([ProbeResult("ok")], hung=True) == 3


def test_finding_validation():
    """Unknown severities and out-of-range confidence are refused; ranks are sorted and unique."""
    with pytest.raises(ValueError, match="severity"):
        Finding("bad", "x")
    with pytest.raises(ValueError, match="confidence"):
        Finding("info", "x", confidence=2)
    assert Finding("info", "x", ranks=[3, 1, 3]).ranks == [1, 3]


def test_status_from_findings():
    """The worst finding decides a probe's status."""
    assert ProbeResult.from_findings("p", []).status == "pass"
    assert ProbeResult.from_findings("p", [Finding("info", "i")]).status == "pass"
    assert ProbeResult.from_findings("p", [Finding("warning", "w")]).status == "warn"
    assert ProbeResult.from_findings("p", [Finding("error", "e")]).status == "fail"


def test_render_names_ranks_and_verdict():
    """The text table shows each probe, findings with their ranks, tables and the verdict."""
    text = render_report(_report())
    assert "collectives" in text and "FAIL" in text
    assert "rank 2: all_reduce wrong on rank 2" in text
    assert "skipped: no NVML" in text
    assert "not run: checkpoint" in text
    assert text.rstrip().splitlines()[-1].startswith("verdict: FAIL (exit 1)")


def test_format_ranks():
    """Rank lists are compressed into spans."""
    assert format_ranks([]) == "job"
    assert format_ranks([3]) == "rank 3"
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "ranks 0-2,5,7-8"
    assert format_ranks([0, 1], world_size=2) == "all ranks"


def test_writer_claim_is_exclusive_within_a_rank_too():
    """A rank's main thread and its sentinel cannot both win the writer role."""
    import torch.distributed as dist

    from distdiag.exchange import Exchange

    ex = Exchange(dist.HashStore(), rank=0, world_size=2)
    assert ex.claim("writer", "main") is True
    assert ex.claim("writer", "sentinel") is False
    assert ex.claim("writer", "main") is True  # the holder asking again
