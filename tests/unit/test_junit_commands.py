"""`--junit PATH` on every judging command (`hang-report`, `analyze`, `watch`), written by the
same writer as `distdiag check --junit`: one suite per command, its name the command's."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET

from typer.testing import CliRunner

from distdiag.cli import app
from distdiag.launcher.watch import _junit_report, _take_junit
from distdiag.report.model import Finding, ProbeResult, Report, write_report
from tests.unit.test_watchdog_cli import dump, entry


def _suite(path) -> ET.Element:
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites"
    return root.find("testsuite")


def test_hang_report_junit_from_a_saved_report_and_from_dumps(tmp_path):
    saved = tmp_path / "saved"
    saved.mkdir()
    probe = ProbeResult.from_findings("watchdog", [Finding("critical", "rank 1 never entered all_reduce #7", ranks=[1])])
    write_report(Report(world_size=2, probes=[probe], exit_code=3, verdict="fail", outcome="hang"), saved / "hang-report.json")
    out = CliRunner().invoke(app, ["hang-report", str(saved), "--junit", str(tmp_path / "a.xml")])
    assert out.exit_code == 3, out.output
    suite = _suite(tmp_path / "a.xml")
    assert suite.get("name") == "distdiag.hang-report" and suite.get("errors") == "1"
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["distdiag_version"] and props["torch_version"]  # what wrote the verdict, as in the JSON
    case = suite.find("testcase[@name='watchdog']")
    assert "never entered all_reduce #7" in case.find("error").get("message")

    dumps = tmp_path / "dumps"
    dumps.mkdir()
    (dumps / "fr_trace_0").write_text(json.dumps(dump([entry(1), entry(2), entry(3)])))
    (dumps / "fr_trace_1").write_text(json.dumps(dump([entry(1), entry(2)])))
    out = CliRunner().invoke(app, ["hang-report", str(dumps), "--junit", str(tmp_path / "b.xml"), "--exit-zero"])
    assert out.exit_code == 0, out.output
    suite = _suite(tmp_path / "b.xml")
    assert suite.find("properties/property[@name='exit_code']").get("value") == "3"


def test_junit_path_that_is_a_link_is_bad_input_before_reading(tmp_path):
    os.symlink(tmp_path / "elsewhere.xml", tmp_path / "link.xml")
    out = CliRunner().invoke(app, ["hang-report", str(tmp_path / "nope"), "--junit", str(tmp_path / "link.xml")])
    assert out.exit_code == 2 and "--junit" in out.output and "symbolic link" in out.output
    assert not (tmp_path / "elsewhere.xml").exists()


def test_analyze_junit(tmp_path):
    log = tmp_path / "run.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 2.0 / (s + 1) if s != 30 else float("nan")}) + "\n"
                           for s in range(60)))
    out = CliRunner().invoke(app, ["analyze", str(log), "--junit", str(tmp_path / "a.xml")])
    suite = _suite(tmp_path / "a.xml")
    assert suite.get("name") == "distdiag.analyze"
    assert out.exit_code != 0 and int(suite.get("failures")) + int(suite.get("errors")) >= 1, out.output


def test_watch_takes_junit_before_the_script_only():
    assert _take_junit(["--nproc-per-node", "2", "--junit", "j.xml", "--", "train.py", "--junit", "x"]) == (
        "j.xml", ["--nproc-per-node", "2", "--", "train.py", "--junit", "x"])
    assert _take_junit(["--junit=j.xml", "--", "t.py"]) == ("j.xml", ["--", "t.py"])
    assert _take_junit(["--", "t.py", "--junit", "x"]) == (None, ["--", "t.py", "--junit", "x"])


def test_watch_junit_report_without_a_hang(tmp_path):
    ok = _junit_report(str(tmp_path / "none.json"), None, 0, 0)
    assert ok.exit_code == 0 and ok.verdict == "pass"
    failed = _junit_report(str(tmp_path / "none.json"), None, 5, 1)
    assert failed.exit_code == 5 and "exited 5" in failed.probes[0].findings[0].issue
    from distdiag.report.junit import junit_xml

    assert 'name="distdiag.watch"' in junit_xml(failed, "distdiag.watch")
