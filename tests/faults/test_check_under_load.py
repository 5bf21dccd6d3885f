"""The check's healthy twins stay silent with the CPU saturated (issue 24: no false positive
under load, for the check as for the watchdog).

Each run starts 3 busy-loop processes beside the ranks (tests/faults/busy.py: bounded
lifetime, killed on the way out) on the check's default limits: a healthy box that is merely
busy must pass, with nothing above info.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.faults.busy import busy_cpus
from tests.harness import run_check

BUSY = 3
PROBES = "env,collectives,loss_parity"


@pytest.mark.timeout(200)
def test_healthy_check_passes_beside_busy_loops(tmp_path):
    """3 ranks (forked by the harness, real store and gloo) run env, collectives and loss_parity
    beside 3 busy loops: every rank exits 0 and the report is a pass with nothing above info."""
    with busy_cpus(BUSY, lifetime_s=180):
        result = run_check(3, ["--probes", PROBES], tmp_path, timeout=170)
    assert not result.timed_out and result.codes == [0, 0, 0], (result.codes, result.stderr[-3000:])
    report = result.report()
    assert report.verdict == "pass" and report.outcome == "completed", report.summary
    assert [(n, f.severity, f.issue) for n, f in report.findings("warning")] == []


@pytest.mark.timeout(200)
def test_distdiag_check_launcher_passes_beside_busy_loops(cli_env, tmp_path):
    """The user's command, `distdiag check --nproc-per-node 2` (torchrun under the launcher),
    beside 3 busy loops: exit 0, this run's passing report on disk, one verdict line."""
    cmd = [sys.executable, "-m", "distdiag", "check", "--nproc-per-node", "2", "--probes", PROBES, "--quiet"]
    with busy_cpus(BUSY, lifetime_s=180):
        out = subprocess.run(cmd, env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    report = json.loads((tmp_path / "distdiag-report.json").read_text())
    assert report["exit_code"] == 0 and report["verdict"] == "pass" and report["world_size"] == 2
    assert out.stdout.count("verdict: PASS (exit 0)") == 1, out.stdout
