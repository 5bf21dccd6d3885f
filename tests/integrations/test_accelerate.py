"""An `accelerate` script under the zero-code wrapper, unchanged but for two step-mark lines
(`torchrun -m distdiag.watch -- script`): a rank sleeping at step 3 ends the job with a report that
shows its line; the healthy twin exits 0 with no report."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from distdiag.report.model import read_report

pytest.importorskip("accelerate")

SCRIPT = Path(__file__).parent / "accelerate_script.py"

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(150)]


def _torchrun(cli_env, tmp_path, *words):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "-m", "distdiag.watch", "--timeout-s", "8", "--", str(SCRIPT), *words]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=120)
    return proc, time.monotonic() - started


def test_sleeping_rank_in_an_accelerate_script_is_named(cli_env, tmp_path):
    proc, elapsed = _torchrun(cli_env, tmp_path, "sleep_rank=1")
    assert proc.returncode != 0, proc.stderr[-3000:]
    crit = [f for f in read_report(tmp_path / "hang-report" / "hang-report.json").probe("watchdog").findings if f.severity == "critical"]
    assert crit and "FAULT:sleep" in crit[0].issue + crit[0].evidence, crit
    assert elapsed < 100, elapsed
    # rank 0 waits in DDP's all-reduce (issued in C++, seen through torch's flight recorder)
    assert crit[0].ranks == [1], crit[0]


def test_healthy_accelerate_script_exits_zero_without_report(cli_env, tmp_path):
    proc, _ = _torchrun(cli_env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "hang-report").exists()
