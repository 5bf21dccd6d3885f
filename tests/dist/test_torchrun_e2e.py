"""A few true end-to-end runs under torchrun (its agent store, its SIGTERM on worker failure)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.timeout(180), pytest.mark.torchrun]


def torchrun(nproc, args, env, cwd, timeout=120):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "-m", "distdiag.check", *args]
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_readme_command_on_defaults(cli_env, tmp_path):
    """The README's main command: 4 ranks on built-in defaults, exit 0, report written, rank 0 prints."""
    out = torchrun(4, [], cli_env, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "distdiag-report.json").read_text())
    assert report["exit_code"] == 0 and report["world_size"] == 4
    assert out.stdout.count("verdict: ") == 1
    assert not [f for p in report["probes"] for f in p["findings"] if f["severity"] not in ("info",)]


def test_killed_rank_under_torchrun_survivors_report(cli_env, tmp_path):
    """torchrun SIGTERMs the survivors when a rank is SIGKILLed: they still write the report, exit 3."""
    env = dict(cli_env, DISTDIAG_INJECT="kill:collectives:1:after=3")
    out = torchrun(3, ["--probes", "env,collectives", "--timeout-s", "5"], env, tmp_path)
    assert out.returncode == 1  # torchrun's own code for any failed worker
    report = json.loads((tmp_path / "distdiag-report.json").read_text())
    assert report["exit_code"] == 3
    lead = next(f for p in report["probes"] for f in p["findings"] if f["severity"] == "critical")
    assert lead["ranks"] == [1]


def test_bad_input_every_rank_one_line(cli_env, tmp_path):
    """Malformed TOML: every rank prints one line and exits 2; nothing hangs."""
    (tmp_path / "bad.toml").write_text("[check\n")
    out = torchrun(2, ["--config", "bad.toml"], cli_env, tmp_path, timeout=60)
    ours = [line for line in out.stderr.splitlines() if line.startswith("distdiag:")]
    assert len(ours) == 2 and all("not valid TOML" in line for line in ours)
    assert json.loads((tmp_path / "distdiag-report.json").read_text())["exit_code"] == 2
