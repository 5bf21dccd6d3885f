"""What a healthy check prints: little when all is well, everything with --verbose, and a progress
line only on a terminal (real torchrun runs; a pseudo-terminal stands in for the user's)."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(300)]

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "distdiag.check"]


def _on_a_terminal(cmd, env, cwd, timeout=240) -> tuple[int, str]:
    """Run cmd with stdout and stderr on a pseudo-terminal; (exit code, everything it drew)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    chunks = []
    try:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        return proc.wait(timeout=timeout), b"".join(chunks).decode(errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()


def test_healthy_default_run_is_one_line_per_probe_and_verbose_shows_all(cli_env, tmp_path):
    """A default PASS: title, header, a row per probe, verdict, report path; --verbose adds findings and tables."""
    out = subprocess.run([sys.executable, "-m", "distdiag", "check", "--nproc", "2"], env=cli_env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "distdiag-report.json").read_text())
    probes = [p["name"] for p in report["probes"]]
    lines = out.stdout.splitlines()
    assert len(lines) == 3 + len(probes) + 3, out.stdout
    assert [line.split()[0] for line in lines[3 : 3 + len(probes)]] == probes
    assert "[info]" not in out.stdout and "\r" not in out.stdout + out.stderr
    tables = [name[6:] for p in report["probes"] for name in p["details"] if name.startswith("table:")]
    assert tables, "the JSON report keeps every table"

    verbose = subprocess.run([sys.executable, "-m", "distdiag", "check", "--nproc", "2", "--verbose"], env=cli_env,
                             cwd=tmp_path, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert "[info]" in verbose.stdout
    for title in tables:
        assert f"  {title}:" in verbose.stdout, title


def test_progress_line_on_a_terminal_only(cli_env, tmp_path):
    """torchrun on a terminal: rank 0 names each probe in a \\r line cleared before the verdict; piped: nothing."""
    code, drawn = _on_a_terminal([*TORCHRUN, "--probes", "env,collectives"], cli_env, tmp_path)
    assert code == 0, drawn[-3000:]
    assert drawn.count("distdiag [1/2] env ...") == 1 and drawn.count("distdiag [2/2] collectives ...") == 1
    clear = "\r" + " " * len("distdiag [2/2] collectives ...") + "\r"
    assert clear in drawn and drawn.index(clear) < drawn.index("distdiag check: 2 rank(s)")

    piped = subprocess.run([*TORCHRUN, "--probes", "env,collectives"], env=cli_env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert piped.returncode == 0 and "distdiag [" not in piped.stdout + piped.stderr


@pytest.mark.parametrize("flag", ["--quiet", "--format=json"])
def test_no_progress_line_when_quiet_or_json(cli_env, tmp_path, flag):
    code, drawn = _on_a_terminal([*TORCHRUN, "--probes", "env", flag], cli_env, tmp_path)
    assert code == 0, drawn[-3000:]
    assert "distdiag [" not in drawn


def test_distdiag_check_on_a_terminal_shows_progress(cli_env, tmp_path):
    """Through the launcher (the ranks' stderr is its pipe) rank 0 draws the line on the terminal's stdout."""
    code, drawn = _on_a_terminal([sys.executable, "-m", "distdiag", "check", "--nproc", "2", "--probes", "env"],
                                 cli_env, tmp_path)
    assert code == 0, drawn[-3000:]
    assert "distdiag [1/1] env ..." in drawn and "verdict: PASS" in drawn


def test_progress_line_is_blanked_when_rank_0_is_the_stuck_one(cli_env, tmp_path):
    """Rank 0 hangs in a probe and rank 1 writes the verdict: rank 0's \\r line is blanked first,
    so the verdict is not drawn over what is left of it."""
    env = {**cli_env, "DISTDIAG_INJECT": "hang:collectives:0"}
    code, drawn = _on_a_terminal([*TORCHRUN, "--probes", "env,collectives", "--timeout-s", "3"], env, tmp_path)
    report = json.loads((tmp_path / "distdiag-report.json").read_text())
    assert report["exit_code"] == 3 and report["written_by"] == 1, drawn[-3000:]
    assert code != 0 and "distdiag [2/2] collectives ..." in drawn
    clear = "\r" + " " * len("distdiag [2/2] collectives ...") + "\r"
    assert clear in drawn and drawn.index(clear) < drawn.index("distdiag check: 2 rank(s)"), drawn[-3000:]
