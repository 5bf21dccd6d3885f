"""`distdiag watch`: torchrun with the zero-code watchdog, launched for the user. The hang report
is the last thing on the terminal (torchrun's log lines and its ChildFailedError traceback are
held back) and the exit code is the verdict's: 3 on a hang, 0 on a healthy script, the
script's own code when it fails by itself, 2 on bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from distdiag.report.model import read_report

SCRIPT = Path(__file__).resolve().parent.parent / "faults" / "watchdog_script.py"


def _watch(cli_env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "distdiag", "watch", "--nproc-per-node", "2", "--standalone", "--timeout-s", "3", *args]
    return subprocess.run(cmd, cwd=cwd, env=cli_env, capture_output=True, text=True, timeout=150)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.torchrun
@pytest.mark.timeout(180)
def test_hang_report_is_the_last_thing_and_the_exit_code_is_3(cli_env, tmp_path):
    """Rank 1 blocks outside any collective (hard timeout on the run): exit 3, the report's
    path is the last line, no traceback of torchrun's and no ranks' 'ending' lines after it."""
    proc = _watch(cli_env, tmp_path, "--junit", str(tmp_path / "watch.xml"), "--", str(SCRIPT), "fault=block", "rank=1", "step=2")
    assert proc.returncode == 3, proc.stderr[-3000:]
    lines = _lines(proc.stderr)
    assert lines[-1] == f"hang report: {tmp_path / 'hang-report' / 'hang-report.json'}", lines[-5:]
    assert "ChildFailedError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert any(line.startswith("verdict: FAIL (exit 3) - rank 1 never entered") for line in lines[-3:]), lines[-5:]
    assert read_report(tmp_path / "hang-report" / "hang-report.json").exit_code == 3
    # --junit: the same verdict as JUnit XML, the report's findings in the watchdog's case
    junit = (tmp_path / "watch.xml").read_text()
    assert 'testsuite name="distdiag.watch"' in junit and "rank 1 never entered" in junit, junit[:2000]


@pytest.mark.torchrun
@pytest.mark.timeout(180)
def test_healthy_script_exits_zero_without_report(cli_env, tmp_path):
    """The twin: a slower step within the timeout: exit 0, no report, no torchrun noise."""
    proc = _watch(cli_env, tmp_path, "--", str(SCRIPT), "fault=slow_step", "rank=1", "step=1", "steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "hang-report").exists()
    assert "Traceback" not in proc.stderr and "OMP_NUM_THREADS" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.torchrun
@pytest.mark.timeout(180)
def test_script_failing_by_itself_keeps_its_code_and_its_traceback(cli_env, tmp_path):
    """Rank 1 exits 5 by itself: exit 5, not torchrun's 1. Rank 1 raises while rank 0 waits in a
    barrier: the watchdog reports the exception that stranded rank 0 (exit 3, outcome raised);
    the script's traceback is shown, torchrun's is not."""
    script = tmp_path / "fails.py"
    script.write_text(
        "import sys\nimport torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "if dist.get_rank() == 1:\n"
        "    if sys.argv[1] == 'raise':\n"
        "        raise ValueError('boom from the script')\n"
        "    sys.exit(5)\n"
        "dist.barrier()\n"
    )
    raised = _watch(cli_env, tmp_path, "--", str(script), "raise")
    assert raised.returncode == 3, raised.stderr[-3000:]
    assert read_report(tmp_path / "hang-report" / "hang-report.json").outcome == "raised"
    assert "ValueError: boom from the script" in raised.stderr and "ChildFailedError" not in raised.stderr
    # in the same folder, seconds later: the raise run's report is not this run's verdict
    exited = _watch(cli_env, tmp_path, "--", str(script), "exit")
    assert exited.returncode == 5, exited.stderr[-3000:]
    assert "ChildFailedError" not in exited.stderr
    # torchrun's summary is held back, so one line says who failed and the code returned
    last = _lines(exited.stderr)[-1]
    assert last.startswith("distdiag watch: rank 1 (pid ") and last.endswith("exited 5 by itself (no hang report); exiting 5"), last


@pytest.mark.torchrun
@pytest.mark.timeout(180)
def test_a_rank_aborted_after_its_script_returned_is_told_apart(cli_env, tmp_path):
    """Rank 1 dies of SIGABRT in the interpreter's exit, after its script returned (what torch's
    gloo worker does on a loaded node, docs/facts.md; forced here by an atexit handler): the line
    says the training ended normally and names the known cause, torchrun's failure code is kept.
    A rank that fails inside the script is still 'by itself' (the test above)."""
    script = tmp_path / "ends.py"
    script.write_text(
        "import atexit, os, signal\nimport torch\nimport torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.ones(4)\ndist.all_reduce(t)\n"
        "if dist.get_rank() == 1:\n"
        "    atexit.register(lambda: os.kill(os.getpid(), signal.SIGABRT))\n"
    )
    proc = _watch(cli_env, tmp_path, "--", str(script))
    assert proc.returncode != 0 and not (tmp_path / "hang-report").exists(), proc.stderr[-3000:]
    last = _lines(proc.stderr)[-1]
    assert last.startswith("distdiag watch: rank 1 (pid ") and "was killed by SIGABRT after its script returned" in last, last
    assert "the training itself ended normally" in last and "docs/facts.md" in last, last
    assert "ChildFailedError" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.timeout(60)
def test_bad_input_is_one_line_exit_2(cli_env, tmp_path):
    """No `--`, a missing script, a bad watch option: one line, exit 2, torchrun never started."""
    for args in ([str(SCRIPT)], ["--", str(tmp_path / "missing.py")], ["--timeout-s", "-1", "--", str(SCRIPT)]):
        proc = subprocess.run([sys.executable, "-m", "distdiag", "watch", *args], cwd=tmp_path, env=cli_env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (args, proc.stderr)
        assert len(_lines(proc.stderr)) == 1 and "error" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.torchrun
@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_cancelled_watch_is_one_line_and_the_cancellation_code(cli_env, tmp_path, sig):
    """Ctrl-C (or a scheduler's SIGTERM) to `distdiag watch` while a healthy job trains: a
    cancellation, not 'the job failed': one line, exit 130, no hang report, no rank left."""
    import signal
    import time

    import psutil

    from distdiag.report.model import EXIT_CANCELLED

    cmd = [sys.executable, "-m", "distdiag", "watch", "--nproc-per-node", "2", "--standalone", "--timeout-s", "30",
           "--", str(SCRIPT), "fault=none", "steps=100000", "step_s=0.05"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root = psutil.Process(proc.pid)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(_rank_pids(root, "watchdog_script")) < 2:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.3)
        time.sleep(6)  # armed and training
        workers = root.children(recursive=True)
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_CANCELLED, err[-3000:]
    said = [line for line in _lines(err) if line.startswith("distdiag watch:")]
    assert len(said) == 1 and said[0].startswith("distdiag watch: cancelled by SIG"), err[-3000:]
    assert not (tmp_path / "hang-report").exists() and "Traceback" not in err, err[-3000:]
    time.sleep(1)
    assert not [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _rank_pids(root, marker: str) -> list[int]:
    import psutil

    out = []
    for p in root.children(recursive=True):
        try:
            line = " ".join(p.cmdline())
            if marker in line and "distdiag.watch" in line and "torch.distributed.run" not in line:
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


@pytest.mark.torchrun
@pytest.mark.timeout(180)
def test_a_rank_stopped_before_its_watchdog_armed_ends_the_job(cli_env, tmp_path):
    """Rank 1 is SIGSTOPped while its script is still before init_process_group: no watchdog is
    armed anywhere (rank 0 waits in the rendezvous), so the launcher's job watch ends the job
    after the timeout and 10 s more, in one line, exit 3, nothing left running."""
    import os
    import signal
    import time

    import psutil

    script = tmp_path / "slow_init.py"
    script.write_text("import time\nimport torch.distributed as dist\ntime.sleep(6)\ndist.init_process_group('gloo')\n"
                      "dist.barrier()\n")
    cmd = [sys.executable, "-m", "distdiag", "watch", "--nproc-per-node", "2", "--standalone", "--timeout-s", "3",
           "--", str(script)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root = psutil.Process(proc.pid)
    try:
        deadline = time.monotonic() + 60
        while len(ranks := _rank_pids(root, "slow_init.py")) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(ranks) == 2, proc.communicate()[1][-3000:] if proc.poll() is not None else "ranks never started"
        os.kill(max(ranks), signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, err[-3000:]
    assert "has been stopped (SIGSTOP or a debugger) for over 13s" in err, err[-3000:]
    assert time.monotonic() - stopped_at < 60
    time.sleep(1)
    assert not [p for p in ranks if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.torchrun
@pytest.mark.timeout(180)
def test_a_killed_agent_leaves_no_rank_training_on(cli_env, tmp_path):
    """torchrun's agent SIGKILLed while the job trains: its ranks would run on, orphaned. The
    launcher ends them and says so in one line, exit 3 (not 247)."""
    import os
    import signal
    import time

    import psutil

    cmd = [sys.executable, "-m", "distdiag", "watch", "--nproc-per-node", "2", "--standalone", "--timeout-s", "30",
           "--", str(SCRIPT), "fault=none", "steps=100000", "step_s=0.05"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root = psutil.Process(proc.pid)
    try:
        deadline = time.monotonic() + 90
        while len(ranks := _rank_pids(root, "watchdog_script")) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(ranks) == 2, "ranks never started"
        time.sleep(4)
        agent = psutil.Process(ranks[0]).parent()
        os.kill(agent.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, err[-3000:]
    said = [line for line in _lines(err) if line.startswith("distdiag watch:")]
    assert said and "agent was killed by signal 9" in said[-1] and "were ended" in said[-1], err[-3000:]
    time.sleep(1)
    assert not [p for p in ranks if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.torchrun
@pytest.mark.timeout(180)
def test_a_stale_hang_report_newer_than_the_launch_is_not_this_runs(cli_env, tmp_path):
    """A hang report an earlier run left (exit 3, another launch id) lands in the dump dir after
    this run started - newer than the launch by its file time - and rank 1 then exits 5 by
    itself: the exit is 5 and --junit says the script failed, not the stale report's hang.
    Its twin: the same script healthy exits 0 with the stale report in place."""
    import os
    import time

    from distdiag.report.model import Finding, ProbeResult, Report, write_report

    stale = tmp_path / "stale.json"
    probe = ProbeResult.from_findings("watchdog", [Finding("critical", "rank 0 never entered all_reduce (an earlier run)")])
    write_report(Report(world_size=2, probes=[probe], exit_code=3, verdict="fail", outcome="hang",
                        summary="an earlier run's hang", launch_id="an-earlier-launch"), stale)
    script = tmp_path / "late_stale.py"
    script.write_text(
        "import os, shutil, sys, time\nimport torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "dist.barrier()\n"
        "if dist.get_rank() == 1:\n"
        "    os.makedirs('hang-report', exist_ok=True)\n"
        "    shutil.copy(sys.argv[1], 'hang-report/hang-report.json.tmp')\n"
        "    os.replace('hang-report/hang-report.json.tmp', 'hang-report/hang-report.json')\n"
        "    if sys.argv[2] == 'exit':\n"
        "        sys.exit(5)\n"
    )
    started = time.time()
    exited = _watch(cli_env, tmp_path, "--junit", str(tmp_path / "watch.xml"), "--", str(script), str(stale), "exit")
    report = tmp_path / "hang-report" / "hang-report.json"
    assert os.stat(report).st_mtime >= started - 1, "the stale report must be newer than the launch"
    assert read_report(report).launch_id == "an-earlier-launch", "this run wrote no report of its own"
    assert exited.returncode == 5, exited.stderr[-3000:]
    last = _lines(exited.stderr)[-1]
    assert last.startswith("distdiag watch: rank 1 (pid ") and last.endswith("exited 5 by itself (no hang report); exiting 5"), last
    junit = (tmp_path / "watch.xml").read_text()
    assert "the script exited 5 without a hang report" in junit and "an earlier run" not in junit, junit[:2000]
    healthy = _watch(cli_env, tmp_path, "--", str(script), str(stale), "stay")
    assert healthy.returncode == 0, healthy.stderr[-3000:]
