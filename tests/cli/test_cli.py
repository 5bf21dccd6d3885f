"""The `distdiag` command and `python -m distdiag.check` as a user runs them (real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from distdiag.report.model import Finding, ProbeResult, Report, write_report
from distdiag.report.render import render_report

pytestmark = pytest.mark.timeout(180)


def distdiag(args, env, cwd, timeout=120):
    return subprocess.run([sys.executable, "-m", "distdiag", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def test_probes_lists_each_probe_with_a_line(cli_env, tmp_path):
    """`distdiag probes` names every registered probe with what it catches."""
    from distdiag.probes import PROBES

    out = distdiag(["probes"], cli_env, tmp_path)
    assert out.returncode == 0, out.stderr
    for name in PROBES:
        assert any(line.startswith(name) for line in out.stdout.splitlines())
    rows = json.loads(distdiag(["probes", "--format", "json"], cli_env, tmp_path).stdout)
    assert {r["name"] for r in rows} == set(PROBES)


def test_report_show_renders_like_rank0(cli_env, tmp_path):
    """`distdiag report show` prints what rank 0 printed and exits with the check's code; --exit-zero exits 0."""
    report = Report(world_size=2, exit_code=1, verdict="fail", summary="x",
                    probes=[ProbeResult.from_findings("collectives", [Finding("error", "bad", ranks=[1])])])
    path = write_report(report, tmp_path / "r.json")
    out = distdiag(["report", "show", str(path)], cli_env, tmp_path)
    assert out.returncode == 1
    assert out.stdout.rstrip("\n") == render_report(report, verbose=False)
    assert "verdict: FAIL (exit 1) - x" in out.stdout
    lenient = distdiag(["report", "show", str(path), "--exit-zero"], cli_env, tmp_path)
    assert lenient.returncode == 0 and "verdict: FAIL (exit 0 with --exit-zero; the verdict's code is 1)" in lenient.stdout
    old = distdiag(["report", "show", str(path), "--exit-code"], cli_env, tmp_path)  # deprecated, accepted
    assert old.returncode == 1 and "verdict: FAIL (exit 1) - x" in old.stdout


def test_report_show_verbose_and_full(cli_env, tmp_path):
    """Terse by default like the check; --verbose adds info findings and every table; --full every row too."""
    rows = [{"i": i} for i in range(20)]
    report = Report(world_size=2, summary="ok", probes=[
        ProbeResult.from_findings("fsdp_plan", [Finding("info", "audited 20")], details={"table:plan": rows})])
    path = write_report(report, tmp_path / "r.json")
    terse = distdiag(["report", "show", str(path)], cli_env, tmp_path).stdout
    assert "audited 20" not in terse and "plan:" not in terse
    verbose = distdiag(["report", "show", "-v", str(path)], cli_env, tmp_path).stdout
    assert "[info] job: audited 20" in verbose and "plan:" in verbose and "8 more row(s)" in verbose
    assert verbose.rstrip("\n") == render_report(report, verbose=True)
    full = distdiag(["report", "show", "--full", str(path)], cli_env, tmp_path).stdout
    assert "audited 20" in full and "more row" not in full and full.count("\n") > verbose.count("\n")


@pytest.mark.parametrize("content", [None, "{trunc", '{"a": 1}'])
def test_report_show_bad_file_is_one_line(cli_env, tmp_path, content):
    """Missing, truncated or foreign files: one line on stderr, exit 2, no traceback."""
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    out = distdiag(["report", "show", str(path)], cli_env, tmp_path)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("distdiag: error:")
    assert "Traceback" not in out.stderr


def test_check_help_explains_every_option(cli_env, tmp_path):
    """Both entry points document every option in --help."""
    helps = [
        distdiag(["check", "--help"], cli_env, tmp_path).stdout,
        subprocess.run([sys.executable, "-m", "distdiag.check", "--help"], env=cli_env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60).stdout,
    ]
    for text in helps:
        for option in ("--probes", "--skip", "--profile", "--config", "--report", "--timeout-s", "--deadline-s",
                       "--format", "--quiet", "--target"):
            assert option in text, (option, text)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--probes", "nope"], "unknown probe 'nope'"),
        (["--timeout-s", "-5"], "check.timeout_s must be a number of seconds > 0"),
        (["--nproc", "1", "--probes", "collectives"], "WORLD_SIZE must be >= 2"),
    ],
)
def test_check_bad_input_before_launch(cli_env, tmp_path, args, words):
    """`distdiag check` validates before paying for torchrun: one line, exit 2."""
    out = distdiag(["check", *args], cli_env, tmp_path)
    assert out.returncode == 2
    assert words in out.stderr and out.stderr.count("\n") == 1


@pytest.mark.torchrun
def test_check_end_to_end_healthy_and_hung(cli_env, tmp_path):
    """`distdiag check --nproc 2`: exit 0 when healthy; a hang gives exit 3 without torchrun's traceback."""
    ok = distdiag(["check", "--nproc", "2", "--probes", "env,collectives"], cli_env, tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "verdict: PASS (exit 0)" in ok.stdout
    env = dict(cli_env, DISTDIAG_INJECT="hang:collectives:1")
    hung = distdiag(["check", "--nproc", "2", "--probes", "env,collectives", "--timeout-s", "3", "--quiet"], env, tmp_path)
    assert hung.returncode == 3, hung.stderr
    assert "rank 1 never entered" in hung.stdout
    assert "ChildFailedError" not in hung.stderr and "Traceback" not in hung.stderr
