"""The zero-code wrapper under real torchrun: `torchrun -m distdiag.watch -- train.py ARGS`."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from distdiag.report.model import read_report

SCRIPT = Path(__file__).parent / "watchdog_script.py"


def _torchrun(cli_env: dict[str, str], tmp_path: Path, *words: str, timeout: float = 60.0) -> tuple[subprocess.CompletedProcess[str], float]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
        "-m", "distdiag.watch", "--timeout-s", "3", "--", str(SCRIPT), *words,
    ]
    env = dict(cli_env)
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - started


@pytest.mark.torchrun
@pytest.mark.timeout(90)
def test_wrapper_names_the_blocked_rank_with_recorder_tail(cli_env, tmp_path):
    """An unchanged script hangs on rank 1: the wrapper armed at init reports it and ends the job."""
    proc, elapsed = _torchrun(cli_env, tmp_path, "fault=block", "rank=1", "step=2")
    assert proc.returncode != 0, proc.stderr[-3000:]
    report = read_report(tmp_path / "hang-report" / "hang-report.json")
    probe = report.probe("watchdog")
    crit = [f for f in probe.findings if f.severity == "critical"]
    assert crit[0].ranks == [1] and "FAULT:block" in crit[0].issue
    assert probe.details.get("flight_recorder"), "the wrapper enables the flight recorder before init"
    assert "distdiag watchdog" in proc.stderr
    assert elapsed < 45


@pytest.mark.torchrun
@pytest.mark.timeout(90)
def test_wrapper_healthy_script_exits_zero_without_report(cli_env, tmp_path):
    proc, _ = _torchrun(cli_env, tmp_path, "fault=slow_step", "rank=1", "step=1", "steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "hang-report").exists()


@pytest.mark.timeout(60)
def test_wrapper_bad_input_is_one_line_exit_2(tmp_path):
    for args in (["--timeout-s", "-1", "--", str(SCRIPT)], ["--", str(tmp_path / "missing.py")], []):
        proc = subprocess.run([sys.executable, "-m", "distdiag.watch", *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.strip().count("\n") == 0 and "error" in proc.stderr and "Traceback" not in proc.stderr
