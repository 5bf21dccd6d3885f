"""A rank lost while it imports torch and the check still gets a report under `torchrun -m
distdiag.check`, where no launcher of ours is there to write one: torchrun SIGTERMs the
survivors at once, and they note the signal, finish importing and write the report naming the
lost rank (its fatal signal when faulthandler caught it). A rank that got SIGTERM itself while
importing is a cancellation (exit 130), as it is later in the run. Real torchrun runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _torchrun(env: dict[str, str], cwd: Path, sig: str, rank: int = 1) -> subprocess.CompletedProcess:
    env = dict(env, DISTDIAG_TEST_DIE_AT_START=str(rank), DISTDIAG_TEST_DIE_AT_START_SIGNAL=sig)
    env["PYTHONPATH"] = str(HERE / "die_at_start") + os.pathsep + env["PYTHONPATH"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "distdiag.check",
           "--probes", "env", "--quiet"]
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=150, stdin=subprocess.DEVNULL)


@pytest.mark.torchrun
@pytest.mark.timeout(200)
@pytest.mark.parametrize(("sig", "rank"), [("SIGKILL", 1), ("SIGSEGV", 1), ("SIGKILL", 0)])
def test_a_rank_killed_while_importing_is_named_by_the_survivors_report(cli_env, tmp_path, sig, rank):
    """A rank killed while importing under plain torchrun: the other writes a FAIL (exit 3) naming it."""
    out = _torchrun(cli_env, tmp_path, sig, rank)
    report_path = tmp_path / "distdiag-report.json"
    assert report_path.exists(), f"no report; stderr:\n{out.stderr[-3000:]}"
    report = json.loads(report_path.read_text())
    assert report["exit_code"] == 3 and report["verdict"] == "fail" and report["outcome"] == "lost_rank", report["summary"]
    assert "verdict: FAIL (exit 3)" in out.stdout
    summary = report["summary"]
    assert f"rank {rank} lost" in summary and "is gone" in summary and "before it checked in" in summary, summary
    assert "importing torch and the check" in summary, summary
    if sig == "SIGSEGV":
        assert "it died of SIGSEGV" in summary, summary
    assert out.returncode == 1  # torchrun's own code for any failed worker


@pytest.mark.torchrun
@pytest.mark.timeout(200)
def test_a_rank_terminated_while_importing_is_a_cancellation_with_a_report(cli_env, tmp_path):
    """Rank 1 SIGTERMed while importing: it finishes importing, and the run ends cancelled (130), reported."""
    out = _torchrun(cli_env, tmp_path, "SIGTERM")
    assert (tmp_path / "distdiag-report.json").exists(), f"no report; stderr:\n{out.stderr[-3000:]}"
    report = json.loads((tmp_path / "distdiag-report.json").read_text())
    assert report["exit_code"] == 130 and report["outcome"] == "cancelled", report["summary"]
    assert "rank 1 received SIGTERM" in report["summary"], report["summary"]
