"""`distdiag check` as a launcher: signals reach torchrun and its workers; a rank lost after a passing
verdict is not a pass. Real torchrun runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from distdiag.launcher.child import JobEnd
from distdiag.launcher.exit_code import exit_code_after_run
from distdiag.launcher.launch import Launch
from distdiag.report.model import EXIT_CANCELLED, Report, read_report, write_report

HERE = Path(__file__).resolve().parent


def _workers(root: psutil.Process) -> list[psutil.Process]:
    """The ranks under `distdiag check`: `python -m distdiag.check` processes (--launch
    torchrun), or the children forked by distdiag.launcher.forkrun (they share its command line)."""
    try:
        procs = {p.pid: (p, " ".join(p.cmdline())) for p in root.children(recursive=True)}
        parents = {pid: p.ppid() for pid, (p, _) in procs.items()}
    except psutil.Error:
        return []
    forked = [p for pid, (p, cmd) in procs.items()
              if "distdiag.launcher.forkrun" in cmd and "distdiag.launcher.forkrun" in procs.get(parents[pid], (None, ""))[1]]
    launched = [p for p, cmd in procs.values() if cmd.endswith(" -m distdiag.check") or " -m distdiag.check " in cmd]
    return forked + [p for p in launched if "torch.distributed.run" not in " ".join(p.cmdline())]


def _connected(proc: psutil.Process) -> bool:
    """The worker reached the job's store (it installs its SIGTERM handling just before)."""
    try:
        conns = proc.net_connections(kind="tcp") if hasattr(proc, "net_connections") else proc.connections(kind="tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_ESTABLISHED for c in conns)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.torchrun
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("sig", "launch"), [(signal.SIGTERM, "fork"), (signal.SIGINT, "fork"), (signal.SIGTERM, "torchrun")])
def test_signal_to_distdiag_check_stops_torchrun_and_every_worker(cli_env, tmp_path, sig, launch):
    """SIGTERM (or SIGINT) mid-run: torchrun and both workers are gone when distdiag check returns, with a report."""
    env = dict(cli_env, DISTDIAG_INJECT="sleep:collectives:1:seconds=90")
    cmd = [sys.executable, "-m", "distdiag", "check", "--nproc", "2", "--probes", "env,collectives", "--timeout-s", "150",
           "--launch", launch]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    root = psutil.Process(proc.pid)
    seen: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while not (len(seen) == 2 and all(map(_connected, seen))) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            seen = _workers(root)
            time.sleep(0.2)
        assert len(seen) == 2, "the workers never started"
        time.sleep(2)  # mid-run: past the imports and the store, rank 1 in its injected sleep
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
        survivors = [p.pid for p in seen if _alive(p)]
        assert survivors == [], f"workers {survivors} outlived distdiag check; stderr: {err[-2000:]}"
        assert proc.returncode == EXIT_CANCELLED, err[-2000:]
        report = json.loads((tmp_path / "distdiag-report.json").read_text())
        assert report["outcome"] == "cancelled" and "cancelled" in report["summary"], report["summary"]
        assert report["exit_code"] == EXIT_CANCELLED
        # Said in one line by the launcher; no rank prints the report about its signal. (The start
        # line and the progress lines before it are signs of life, not what the cancellation says.)
        from distdiag.report.render import is_beat_line

        name = "SIGINT (Ctrl-C)" if sig == signal.SIGINT else "SIGTERM"
        assert [line for line in err.strip().splitlines() if not is_beat_line(line)] == [f"distdiag: cancelled by {name}: {report['summary']}; "
                                            f"report: {tmp_path / 'distdiag-report.json'} (exit {EXIT_CANCELLED})"], err
        assert out == "", out
    finally:
        for p in [root, *seen]:
            if _alive(p):
                p.kill()
        if proc.poll() is None:
            proc.kill()


def test_pass_report_with_failed_torchrun_is_exit_3(tmp_path, capsys):
    """This run's report says 0, torchrun says 1 (a rank died after the verdict): one line, exit 3,
    and the report on disk says 3 too (its probes kept)."""
    with Launch(str(tmp_path / "r.json"), 2) as launch:
        write_report(Report(world_size=2, launch_id=launch.id), launch.report_path)
        assert exit_code_after_run(launch, JobEnd(1)) == 3
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "the probes passed but torchrun exited 1: a rank failed after the verdict" in err
        amended = read_report(launch.report_path)
        assert amended.exit_code == 3 and amended.outcome == "lost_rank" and "after the verdict" in amended.notes[-1]
        write_report(Report(world_size=2, launch_id=launch.id), launch.report_path)
        assert exit_code_after_run(launch, JobEnd(0)) == 0


@pytest.mark.torchrun
@pytest.mark.timeout(180)
def test_rank_lost_after_a_passing_verdict_is_exit_3(cli_env, tmp_path):
    """Real run: rank 1 is SIGKILLed after it learnt the verdict; the exit is 3 and the report says so."""
    env = dict(cli_env, DISTDIAG_TEST_DIE_AFTER_VERDICT="1")
    env["PYTHONPATH"] = str(HERE / "die_after_verdict") + os.pathsep + env["PYTHONPATH"]
    out = subprocess.run([sys.executable, "-m", "distdiag", "check", "--nproc", "2", "--probes", "env"], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=150, stdin=subprocess.DEVNULL)
    assert "verdict: PASS" in out.stdout, out.stderr[-2000:]
    assert out.returncode == 3, out.stderr[-2000:]
    assert "a rank failed after the verdict; exiting 3" in out.stderr
    assert json.loads((tmp_path / "distdiag-report.json").read_text())["exit_code"] == 3
