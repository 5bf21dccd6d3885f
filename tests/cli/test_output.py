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


def test_plain_logs_get_a_start_line_and_progress(cli_env, tmp_path):
    """Piped (CI, Slurm): `distdiag check` says it started at once, and while a probe runs long rank 0
    says every 10 s which probe runs, for how long, against which deadline; nothing after the verdict."""
    env = {**cli_env, "DISTDIAG_INJECT": "sleep:collectives:0:seconds=13"}
    out = subprocess.run([sys.executable, "-m", "distdiag", "check", "--nproc", "2", "--probes", "env,collectives",
                          "--timeout-s", "40"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=150,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stderr.splitlines()
    assert lines[0] == "distdiag check: starting 2 rank(s) on this machine; each probe has 40 s, the check 600 s", lines
    beats = [line for line in lines if line.startswith("distdiag check: ") and " s in: probe collectives [2/2]" in line]
    assert beats and beats[0].endswith("of its 40 s"), lines
    assert "\r" not in out.stderr and "verdict: PASS" in out.stdout


def test_progress_beat_stops_at_the_verdict():
    """PlainBeat: nothing before its first interval, a line per interval, nothing once stopped."""
    import io
    import time

    from distdiag.report.render import PlainBeat, is_beat_line

    stream = io.StringIO()
    beat = PlainBeat(stream, 60.0, every_s=0.05)
    beat.at(1, 3, "collectives")
    time.sleep(0.23)
    beat.stop()
    beat.thread.join(timeout=2)
    written = stream.getvalue().splitlines()
    assert 2 <= len(written) <= 5 and all(is_beat_line(line) for line in written), written
    assert "probe collectives [2/3] running for 0 s of its 60 s" in written[0]
    time.sleep(0.12)
    assert stream.getvalue().splitlines() == written
