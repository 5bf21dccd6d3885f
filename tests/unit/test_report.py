"""The report contract: round trip, atomic writes, exit-code precedence, clear read errors."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from distdiag.errors import ReportError
from distdiag.report.model import (
    SCHEMA,
    Finding,
    ProbeResult,
    RankInfo,
    Report,
    exit_code_for,
    read_report,
    write_report,
)
from distdiag.report.render import format_ranks, render_report


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

    from distdiag.runtime.exchange import Exchange

    ex = Exchange(dist.HashStore(), rank=0, world_size=2)
    assert ex.claim("writer", "main") is True
    assert ex.claim("writer", "sentinel") is False
    assert ex.claim("writer", "main") is True  # the holder asking again


@pytest.mark.parametrize("link", ["to-file", "dangling", "loop"])
def test_write_refuses_a_symlink(tmp_path, link):
    """A report path that is a symlink is never written through: the file it points to stays
    as it was, a dangling link's target is not created, a loop is one line (issue 24)."""
    victim = tmp_path / "store" / "victim"
    victim.parent.mkdir()
    path = tmp_path / "r.json"
    if link == "to-file":
        victim.write_text("precious")
        path.symlink_to(victim)
    elif link == "dangling":
        path.symlink_to(victim)
    else:
        path.symlink_to(tmp_path / "r.json")
    words = {"to-file": "is a symbolic link (to", "dangling": "is a dangling symbolic link", "loop": "is a symbolic link loop"}
    with pytest.raises(OSError, match="refusing to write through it") as info:
        write_report(_report(), path)
    assert words[link] in str(info.value) and "\n" not in str(info.value)
    assert path.is_symlink()
    assert (victim.read_text() == "precious") if link == "to-file" else not victim.exists()
    assert sorted(os.listdir(tmp_path)) == ["r.json", "store"]  # no temp file left behind


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_write_refuses_what_is_not_a_regular_file(tmp_path, kind):
    """A FIFO, a directory or a device (/dev/null) is left alone, with one line."""
    path = tmp_path / "r.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path = Path("/dev/null")
    with pytest.raises(OSError, match="not a regular file; refusing to replace it") as info:
        write_report(_report(), path)
    assert "\n" not in info.value.strerror
    assert {"fifo": path.is_fifo, "directory": path.is_dir, "device": path.is_char_device}[kind]()
    assert os.listdir(tmp_path) == ([] if kind == "device" else ["r.json"])  # no temp file left behind


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_report_mode_is_0644_minus_umask(tmp_path, umask, mode):
    """Reports are readable like any file the user writes (mkstemp alone made them 0600)."""
    old = os.umask(umask)
    try:
        path = write_report(_report(), tmp_path / "r.json")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == mode


def _valid() -> dict:
    return json.loads(_report().to_json())


def _set(data: dict, dotted: str, value) -> dict:
    *parts, last = dotted.split(".")
    node = data
    for part in parts:
        node = node[int(part)] if part.isdigit() else node[part]
    node[int(last) if last.isdigit() else last] = value
    return data


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("probes.0.findings", 5, "probes[0].findings must be a list, got int"),
        ("probes.0.findings.0", ["error", "x"], "probes[0].findings[0] must be an object, got list"),
        ("probes.0.findings.0.evidence", 5, "probes[0].findings[0].evidence must be a string, got int"),
        ("probes.0.findings.0.ranks", "x", "probes[0].findings[0].ranks must be a list, got string"),
        ("probes.0.findings.0.ranks", ["x"], "ranks must be a list of integers"),
        ("probes.0.findings.0.drain", "node1", "drain must be an object"),
        ("probes.0.name", 7, "probes[0].name must be a string"),
        ("probes.1", [1], "probes[1] must be an object, got list"),
        ("probes", {"a": 1}, "probes must be a list, got object"),
        ("ranks.0.host", None, "ranks[0].host"),
        ("verdict", 1, "verdict must be a string"),
        ("world_size", "4", "world_size must be an integer, got string"),
        ("exit_code", 300, "exit_code must be within [0, 255]"),
        ("not_run", [1], "not_run[0] must be a string"),
    ],
)
def test_mistyped_fields_are_one_line_naming_the_field(tmp_path, field, value, words):
    """A hand-edited report with a wrong type says which field, instead of crashing the renderer."""
    path = tmp_path / "r.json"
    data = _set(_valid(), field, value)
    if value is None:
        del data["ranks"][0]["host"]
        words = "missing field ranks[0].host"
    path.write_text(json.dumps(data))
    with pytest.raises(ReportError, match=re.escape(words)) as info:
        read_report(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"\xff\xfe{\x00", "is not UTF-8 text (byte 0xff at offset 0)"),
        (b"[" * 100_000 + b"]" * 100_000, "nests JSON too deeply"),
        (b'{"schema": "distdiag.report/1", "world_size": 1, "config": ' + b"[" * 200 + b"]" * 200 + b"}", "deeper than 64 levels"),
    ],
)
def test_binary_or_deep_files_are_one_line(tmp_path, content, words):
    """Non-UTF-8 bytes and deep nesting (RecursionError once) are ReportErrors."""
    path = tmp_path / "r.json"
    path.write_bytes(content)
    with pytest.raises(ReportError, match=re.escape(words)):
        read_report(path)


def test_reading_a_fifo_is_refused_not_blocked(tmp_path):
    """A FIFO at the path would block the reader forever: refused at once."""
    path = tmp_path / "r.json"
    os.mkfifo(path)
    with pytest.raises(ReportError, match=r"is a FIFO \(named pipe\), not a report file"):
        read_report(path)


def _healthy() -> Report:
    table = {"table:plan": [{"fqn": f"layer{i}", "ok": "yes"} for i in range(3)]}
    return Report(
        world_size=2,
        probes=[
            ProbeResult.from_findings("env", [Finding("info", "4 ranks share 2 cores", "threads 1")]),
            ProbeResult.from_findings("fsdp_plan", [Finding("info", "audited 25 parameters")], details=table),
            ProbeResult("gpu", status="skip", reason="no NVML"),
        ],
        summary="all passed",
    )


def test_healthy_run_renders_one_line_per_probe_and_the_verdict():
    """Terse (the check's default): no info findings, no tables of a probe without trouble."""
    lines = render_report(_healthy(), verbose=False).splitlines()
    assert lines[3:6] == [line for line in lines if line.split(" ", 1)[0] in ("env", "fsdp_plan", "gpu")]
    assert len(lines) == 3 + 3 + 2  # title, header, rule; a row per probe; blank, verdict
    assert "1 info" in lines[3]  # counted, not shown


def test_verbose_renders_every_finding_and_table():
    text = render_report(_healthy(), verbose=True)
    assert "[info] job: 4 ranks share 2 cores" in text and "  plan:" in text and "layer2" in text


def test_terse_still_shows_trouble_with_its_tables():
    """A probe with a warning or worse keeps its findings and tables; info findings stay hidden."""
    report = _healthy()
    report.probes[1] = ProbeResult.from_findings(
        "fsdp_plan", [Finding("warning", "memory unbalanced", ranks=[1]), Finding("info", "audited")],
        details={"table:plan": [{"fqn": "a"}]},
    )
    text = render_report(report, verbose=False)
    assert "[WARN] rank 1: memory unbalanced" in text and "  plan:" in text
    assert "audited" not in text and "4 ranks share" not in text
    assert "[info] job: audited" in render_report(report, verbose=False, min_severity="info")


def test_progress_line_is_silent_off_a_terminal(capsys):
    """Under pytest (captured, not a TTY) the check's progress line draws nothing."""
    from distdiag.check.config import CheckConfig
    from distdiag.report.render import ProgressLine

    line = ProgressLine.for_check(CheckConfig(), 0)
    line.show(0, 3, "env")
    line.clear()
    assert capsys.readouterr() == ("", "")


def test_progress_line_rewrites_one_line_and_clears_it():
    import io

    from distdiag.report.render import ProgressLine

    stream = io.StringIO()
    line = ProgressLine(stream)
    line.show(0, 2, "collectives")
    line.show(1, 2, "env")
    line.clear()
    line.show(1, 2, "late")  # after the verdict: nothing
    text = stream.getvalue()
    assert "\n" not in text
    assert text == (
        "\rdistdiag [1/2] collectives ...\r"
        "\rdistdiag [2/2] env ...        \r"  # padded over the longer line before it
        "\r" + " " * len("distdiag [2/2] env ...") + "\r"
    )


def test_every_outcome_the_code_writes_is_documented():
    """report-schema.md's outcome line names every outcome the check, the watchdog and the
    launcher write (issue 24: every outcome documented)."""
    from pathlib import Path

    from distdiag.check.finish import _outcome as check_outcome
    from distdiag.watchdog.writer import _outcome as watchdog_outcome

    doc = (Path(__file__).resolve().parents[2] / "docs" / "report-schema.md").read_text()
    line = next(ln for ln in doc.splitlines() if ln.strip().startswith('"outcome":'))
    documented = {w.strip(' ",') for w in line.split(":", 1)[1].split("|")}
    written = {"completed", "bad_input", "cancelled", "lost_rank"}  # build_report, the launcher's leave_report
    for kinds in ({"lost"}, {"stranded"}, {"deadline"}, {"timeout"}, {"terminated"}, set()):
        written.add(check_outcome(kinds, cancelled=False, lost=None))
    written.add(check_outcome(set(), cancelled=True, lost=None))
    for kind in ("desync", "raised", "timeout"):
        written.add(watchdog_outcome({"kind": kind}, {}))
    assert written - documented == set(), written - documented
