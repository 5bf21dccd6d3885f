"""Files a careless user (or a fault campaign) hands the CLI: one line on stderr and exit 2, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from distdiag.report.model import Finding, ProbeResult, Report

pytestmark = pytest.mark.timeout(120)


def distdiag(args, env, cwd, module="distdiag"):
    return subprocess.run([sys.executable, "-m", module, *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=90, stdin=subprocess.DEVNULL)


def _one_line_exit_2(out, words):
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("distdiag: error:"), out.stderr
    assert words in out.stderr, out.stderr


def _report_json() -> dict:
    report = Report(world_size=2, exit_code=1, verdict="fail", summary="x",
                    probes=[ProbeResult.from_findings("collectives", [Finding("error", "bad", "ev", ranks=[1])])])
    return json.loads(report.to_json())


BAD_REPORTS = {
    "binary": (b"\x89PNG\r\n\x1a\n\xff", "is not UTF-8 text"),
    "deep": (b"[" * 50_000 + b"]" * 50_000, "nests JSON too deeply"),
    "findings-int": (None, "probes[0].findings must be a list, got int"),
    "finding-list": (None, "probes[0].findings[0] must be an object, got list"),
}


@pytest.mark.parametrize("case", list(BAD_REPORTS))
def test_report_show_bad_files(cli_env, tmp_path, case):
    """`distdiag report show` on non-UTF-8, deeply nested or mistyped files."""
    content, words = BAD_REPORTS[case]
    if content is None:
        data = _report_json()
        data["probes"][0]["findings"] = 5 if case == "findings-int" else [["error", "bad"]]
        content = json.dumps(data).encode()
    (tmp_path / "r.json").write_bytes(content)
    _one_line_exit_2(distdiag(["report", "show", "r.json"], cli_env, tmp_path), words)


def test_report_show_fifo_is_refused(cli_env, tmp_path):
    """A FIFO would block the reader: refused at once."""
    os.mkfifo(tmp_path / "r.json")
    _one_line_exit_2(distdiag(["report", "show", "r.json"], cli_env, tmp_path), "is a FIFO (named pipe)")


BAD_DUMPS = {
    "binary": (b"\xff\xfe\x00garbage", "neither JSON nor a pickle"),
    "deep": (b'{"entries": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "too deeply"),
    "entries-str": (b'{"entries": "x"}', "'entries' must be a list, got str"),
    "entry-list": (b'{"entries": [["all_reduce", 1]]}', "entries[0] must be an object, got list"),
    "seq-str": (b'{"entries": [{"collective_seq_id": "x", "process_group": ["0", "default"]}]}',
                "entries[0].collective_seq_id must be an integer"),
    "pg-int": (b'{"entries": [{"collective_seq_id": 1, "process_group": 5}]}', "process_group must be a non-empty list"),
}


@pytest.mark.parametrize("case", list(BAD_DUMPS))
def test_hang_report_bad_dumps(cli_env, tmp_path, case):
    """`distdiag hang-report DIR` on dumps that are binary, deep or of the wrong shape."""
    content, words = BAD_DUMPS[case]
    (tmp_path / "dumps").mkdir()
    (tmp_path / "dumps" / "rank_0").write_bytes(content)
    _one_line_exit_2(distdiag(["hang-report", "dumps"], cli_env, tmp_path), words)


@pytest.mark.parametrize("case", list(BAD_REPORTS))
def test_hang_report_bad_watchdog_report(cli_env, tmp_path, case):
    """A broken hang-report.json says what is wrong with it (not 'no entries')."""
    content, words = BAD_REPORTS[case]
    if case == "binary":  # not starting with "{", it is read as a dump
        words = "neither JSON nor a pickle"
    if content is None:
        data = _report_json()
        data["probes"][0]["findings"] = 5 if case == "findings-int" else [["error", "bad"]]
        content = json.dumps(data).encode()
    (tmp_path / "hang-report").mkdir()
    (tmp_path / "hang-report" / "hang-report.json").write_bytes(content)
    _one_line_exit_2(distdiag(["hang-report", "hang-report"], cli_env, tmp_path), words)


def test_hang_report_fifo_is_refused(cli_env, tmp_path):
    os.mkfifo(tmp_path / "dump")
    _one_line_exit_2(distdiag(["hang-report", "dump"], cli_env, tmp_path), "is a FIFO (named pipe)")


@pytest.mark.parametrize("front", ["distdiag check", "python -m distdiag.check"])
@pytest.mark.parametrize("flag", ["--report", "--junit"])
def test_check_refuses_a_fifo_as_output(cli_env, tmp_path, front, flag):
    """--report/--junit naming a FIFO is bad input before anything runs."""
    os.mkfifo(tmp_path / "out")
    args = ["--probes", "env", flag, "out"]
    if front == "distdiag check":
        out = distdiag(["check", "--nproc", "1", *args], cli_env, tmp_path)
    else:
        out = distdiag(args, cli_env, tmp_path, module="distdiag.check")
    key = "check.report" if flag == "--report" else "check.junit"
    _one_line_exit_2(out, f"{key}: out is a FIFO (named pipe), not a regular file; refusing to replace it (pass {flag} a file path)")
    assert (tmp_path / "out").is_fifo()
