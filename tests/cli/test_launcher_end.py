"""`distdiag check` exits 0 only with this run's passing report in hand, and the job it started
ends whatever happens to the launcher, the agent or a rank (issue 24). Real torchrun runs
with hard timeouts, each fault beside a healthy twin."""

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
from distdiag.launcher.exit_code import exit_code_after_run, lost_rank_words
from distdiag.launcher.launch import Launch
from distdiag.launcher.ranks import VERDICT_NOTE_ENV, note_verdict
from distdiag.report.model import EXIT_CANCELLED, Report, read_report, write_report
from distdiag.runtime.exchange import STORE_STALL_S
from tests.cli.test_launcher_run import _alive, _connected, _workers

HERE = Path(__file__).resolve().parent
CHECK = [sys.executable, "-m", "distdiag", "check", "--nproc", "2"]


def _run(args, env, cwd, timeout=150):
    return subprocess.run([*CHECK, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _lines(err: str) -> list[str]:
    """What the launcher said, without the check's start and progress lines (signs of life)."""
    from distdiag.report.render import is_beat_line

    return [line for line in err.strip().splitlines() if line.strip() and not is_beat_line(line)]


# -- the exit code, from this run alone (no processes) ---------------------------------------

def test_an_earlier_runs_passing_report_never_passes_for_this_run(tmp_path, capsys):
    """A PASS on disk from another run and torchrun exiting 0 with no report of ours: exit 3, said."""
    path = tmp_path / "distdiag-report.json"
    write_report(Report(world_size=2, launch_id="another-run"), path)
    with Launch(str(path), 2) as launch:
        assert not path.exists(), "the earlier run's report must be gone before the ranks start"
        write_report(Report(world_size=2, launch_id="another-run"), path)  # e.g. a concurrent run
        assert exit_code_after_run(launch, JobEnd(0)) == 3
        (line,) = _lines(capsys.readouterr().err)
        assert "torchrun exited 0 but no rank reported a verdict" in line
        left = read_report(path)
        assert left.launch_id == launch.id and left.exit_code == 3 and left.outcome == "lost_rank"


def test_this_runs_passing_report_is_a_pass(tmp_path, capsys):
    """Healthy twin: this run's PASS and torchrun's 0 are exit 0, with nothing said."""
    with Launch(str(tmp_path / "r.json"), 2) as launch:
        write_report(Report(world_size=2, launch_id=launch.id), launch.report_path)
        assert exit_code_after_run(launch, JobEnd(0)) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("verdict", "code"), [(1, 1), (4, 4), (0, 3)])
def test_a_verdict_whose_report_could_not_be_written_keeps_its_code(tmp_path, capsys, monkeypatch, verdict, code):
    """The writer noted exit 1 (or 4) but could not write the report: that code, one line (a pass: 3)."""
    with Launch(str(tmp_path / "r.json"), 2) as launch:
        monkeypatch.setenv(VERDICT_NOTE_ENV, launch.note_path)
        monkeypatch.setenv("DISTDIAG_LAUNCH_ID", launch.id)
        note_verdict(verdict, report_written=False)
        assert exit_code_after_run(launch, JobEnd(1)) == code
    (line,) = _lines(capsys.readouterr().err)
    assert "could not be written" in line and f"exiting {code}" in line


def test_a_signal_before_any_report_is_one_cancellation_line(tmp_path, capsys):
    """Ctrl-C while the ranks start: one line saying so, the cancellation's code, a report saying cancelled."""
    with Launch(str(tmp_path / "r.json"), 2) as launch:
        assert exit_code_after_run(launch, JobEnd(-9, "SIGINT")) == EXIT_CANCELLED
        (line,) = _lines(capsys.readouterr().err)
        assert line.startswith("distdiag: cancelled by SIGINT (Ctrl-C)"), line
        assert read_report(launch.report_path).outcome == "cancelled"
        assert read_report(launch.report_path).exit_code == EXIT_CANCELLED


def test_the_rank_torchrun_saw_fail_first_is_named_with_what_it_noted(tmp_path):
    """torchrun's root-cause block and the rank's phase note give one clause naming rank, pid, host, signal, phase."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failure = ProcessFailure(local_rank=1, pid=4242, exitcode=-9, error_file="/nonexistent")
    text = ChildFailedError("distdiag.check", {1: failure}).format_msg()
    with Launch(str(tmp_path / "r.json"), 2) as launch:
        (Path(launch.folder) / "rank-1.json").write_text(json.dumps({"phase": "importing torch and the check", "pid": 4242}))
        words = lost_rank_words(launch, text.splitlines(keepends=True))
    assert words is not None and words.startswith("rank 1 (pid 4242 on host ")
    assert words.endswith("ended first (killed by SIGKILL) while importing torch and the check"), words


def test_a_signal_as_a_passing_run_finishes_is_still_a_cancellation(tmp_path, capsys):
    """Ctrl-C that came too late to stop a passing run: one line, the cancellation's code (a gate must not start the job)."""
    with Launch(str(tmp_path / "r.json"), 2) as launch:
        write_report(Report(world_size=2, launch_id=launch.id), launch.report_path)
        assert exit_code_after_run(launch, JobEnd(0, "SIGINT")) == EXIT_CANCELLED
    (line,) = _lines(capsys.readouterr().err)
    assert line.startswith("distdiag: cancelled by SIGINT (Ctrl-C) as the run finished") and line.endswith(f"exit {EXIT_CANCELLED}")


def test_a_signal_as_a_passing_run_finishes_is_a_cancellation_when_torchrun_exits_1_for_it(tmp_path, capsys):
    """The same Ctrl-C where the forwarded signal ended ranks that were leaving (torchrun exits 1,
    seen with `timeout -s INT 8.5 distdiag check --nproc-per-node 3`): still the cancellation's
    one line, not 'a rank failed after the verdict'."""
    with Launch(str(tmp_path / "r.json"), 2) as launch:
        write_report(Report(world_size=2, launch_id=launch.id), launch.report_path)
        assert exit_code_after_run(launch, JobEnd(1, "SIGINT")) == EXIT_CANCELLED
        amended = read_report(launch.report_path)  # the report on disk agrees with the exit code
        assert amended.exit_code == EXIT_CANCELLED and amended.outcome == "cancelled"
    (line,) = _lines(capsys.readouterr().err)
    assert line.startswith("distdiag: cancelled by SIGINT (Ctrl-C) as the run finished") and line.endswith(f"exit {EXIT_CANCELLED}")


# -- real runs ---------------------------------------------------------------------------------

@pytest.mark.torchrun
@pytest.mark.timeout(240)
def test_bad_input_after_a_passing_run_leaves_a_bad_input_report(cli_env, tmp_path):
    """A passing run (healthy twin: exit 0, its report carries its launch id), then a typo in a
    probe name under both launches: exit 2, and the report on disk says bad input, not PASS."""
    ok = _run(["--probes", "env", "--quiet"], cli_env, tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    report = json.loads((tmp_path / "distdiag-report.json").read_text())
    assert report["exit_code"] == 0 and len(report["launch_id"]) == 32
    for launch in ("fork", "torchrun"):
        bad = _run(["--probes", "env,bandwith", "--launch", launch], cli_env, tmp_path)
        assert bad.returncode == 2, (launch, bad.stderr[-2000:])
        assert len(_lines(bad.stderr)) == 1 and "'bandwith'" in bad.stderr, bad.stderr
        report = json.loads((tmp_path / "distdiag-report.json").read_text())
        assert report["exit_code"] == 2 and report["outcome"] == "bad_input", (launch, report)


@pytest.mark.torchrun
@pytest.mark.timeout(150)
def test_a_failing_verdict_whose_report_cannot_be_written_keeps_exit_1(cli_env, tmp_path):
    """The report cannot be created (a folder of /proc: it passes the up-front path check, which
    refuses links, FIFOs and a parent that is not a folder, but no file can be made there, even
    as root): the FAIL verdict (exit 1) stays 1, with one line saying so."""
    env = dict(cli_env, DISTDIAG_INJECT="corrupt:collectives:1:after=2")
    out = _run(["--probes", "env,collectives", "--quiet", "--report", "/proc/r.json"], env, tmp_path)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "verdict: FAIL (exit 1)" in out.stdout
    assert "the verdict (exit 1) could not be written to" in out.stderr


@pytest.mark.torchrun
@pytest.mark.timeout(240)
@pytest.mark.parametrize("launch", ["fork", "torchrun"])
def test_every_rank_leaving_with_0_before_the_verdict_is_not_a_pass(cli_env, tmp_path, launch):
    """A target whose every rank calls os._exit(0) in its build_model hook (os._exit while the
    target is imported is bad input instead: distdiag/check/target.py): no report, so exit 3
    (said), and the fork launch ends too (torchrun's agent waited forever for the ranks' results)."""
    target = tmp_path / "leaves.py"
    target.write_text(
        "import os\n\n\ndef build_model():\n    os._exit(0)\n\n\n"
        "def make_batch(step):\n    raise AssertionError('never reached')\n\n\n"
        "def loss_fn(model, batch):\n    raise AssertionError('never reached')\n"
    )
    out = _run(["--probes", "env,loss_parity", "--target", str(target), "--launch", launch], cli_env, tmp_path, timeout=200)
    assert out.returncode == 3, out.stderr[-2000:]
    assert "no rank could write the report" in out.stderr, out.stderr[-2000:]
    assert json.loads((tmp_path / "distdiag-report.json").read_text())["exit_code"] == 3


def _start(args, env, cwd):
    proc = subprocess.Popen([*CHECK, *args], env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL)
    return proc, psutil.Process(proc.pid)


def _wait_workers(proc, root, connected: bool, limit_s: float = 120, may_end: bool = False) -> list[psutil.Process]:
    """The two workers once they run (and reach the store, `connected`); `may_end`: the whole
    job may already be over (a fast run), then whatever was seen."""
    seen: list[psutil.Process] = []
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if may_end and proc.poll() is not None:
            return seen
        assert proc.poll() is None, proc.communicate()
        seen = _workers(root)
        if len(seen) == 2 and (not connected or all(map(_connected, seen))):
            return seen
        time.sleep(0.05)
    raise AssertionError("the workers never started")


def _cleanup(procs) -> None:
    for p in procs:
        try:
            p.resume()
            p.kill()
        except psutil.Error:
            pass


@pytest.mark.torchrun
@pytest.mark.timeout(180)
def test_ctrl_c_twice_while_the_ranks_import_is_a_cancellation_not_a_pass(cli_env, tmp_path):
    """Two SIGINTs while the ranks import torch: the launcher kills the job, exits 3 (not 0) with
    one line saying it was cancelled, and leaves no process behind."""
    proc, root = _start(["--probes", "env", "--launch", "torchrun"], cli_env, tmp_path)
    seen = []
    try:
        seen = _wait_workers(proc, root, connected=False)
        agent = root.children()
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == EXIT_CANCELLED, err[-2000:]
        (line,) = _lines(err)
        assert line.startswith("distdiag: cancelled by SIGINT (Ctrl-C)"), err
        assert [p.pid for p in [*seen, *agent] if _alive(p)] == []
    finally:
        _cleanup([*seen, root])
        if proc.poll() is None:
            proc.kill()


@pytest.mark.torchrun
@pytest.mark.timeout(180)
def test_a_rank_stopped_after_a_passing_verdict_is_ended(cli_env, tmp_path):
    """Rank 1 SIGSTOPs itself where it would leave after a PASS: the job still ends (the stopped
    rank is killed), the exit is 3 with one line, nothing is left behind."""
    env = dict(cli_env, DISTDIAG_TEST_DIE_AFTER_VERDICT="1", DISTDIAG_TEST_AFTER_VERDICT_SIGNAL="SIGSTOP")
    env["PYTHONPATH"] = str(HERE / "die_after_verdict") + os.pathsep + env["PYTHONPATH"]
    proc, root = _start(["--probes", "env", "--quiet"], env, tmp_path)
    seen = []
    try:
        seen = _wait_workers(proc, root, connected=False, may_end=True)
        out, err = proc.communicate(timeout=120)
        assert "verdict: PASS" in out, err[-2000:]
        assert proc.returncode == 3, err[-2000:]
        assert "was stopped after the verdict; it was killed" in err, err[-2000:]
        assert [p.pid for p in seen if _alive(p)] == []
    finally:
        _cleanup([*seen, root])
        if proc.poll() is None:
            proc.kill()


@pytest.mark.torchrun
@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", ["kill-launcher", "stop-agent", "stop-agent-kill-launcher"])
def test_the_job_ends_when_the_launcher_is_killed_or_the_agent_stopped(cli_env, tmp_path, fault):
    """SIGKILL of `distdiag check` mid-probe: the agent and ranks end by themselves. SIGSTOP of
    torchrun's agent: the launcher ends the job (exit 3, one line naming the agent). Both: the
    store answers no rank, and each rank leaves once a store call waited STORE_STALL_S."""
    env = dict(cli_env, DISTDIAG_INJECT="sleep:collectives:1:seconds=90")
    proc, root = _start(["--probes", "env,collectives", "--timeout-s", "120"], env, tmp_path)
    seen, agent = [], []
    try:
        seen = _wait_workers(proc, root, connected=True)
        agent = root.children()
        time.sleep(1)
        if fault == "stop-agent-kill-launcher":
            agent[0].suspend()
            proc.kill()
            deadline = time.monotonic() + STORE_STALL_S + 60
            while any(map(_alive, seen)) and time.monotonic() < deadline:
                time.sleep(0.5)  # ended ranks stay zombies: their stopped agent cannot reap them
            alive = [p.pid for p in seen if _alive(p)]
            assert alive == [], f"ranks left behind with their store host stopped: {alive}"
            return
        if fault == "kill-launcher":
            proc.kill()
            proc.communicate(timeout=30)
        else:
            agent[0].suspend()
            out, err = proc.communicate(timeout=90)
            assert proc.returncode == 3, err[-2000:]
            assert "torchrun's agent" in err and "stopped" in err, err[-2000:]
        gone, alive = psutil.wait_procs([*seen, *agent], timeout=60)
        assert alive == [], f"left behind: {[p.pid for p in alive]}"
    finally:
        _cleanup([*seen, *agent, root])
        if proc.poll() is None:
            proc.kill()


@pytest.mark.torchrun
@pytest.mark.timeout(180)
def test_a_rank_lost_while_starting_is_named_with_its_host_and_what_it_was_doing(cli_env, tmp_path):
    """Rank 1 SIGKILLed while the ranks import: rank 0 survives torchrun's SIGTERM and reports it
    lost (exit 3); the launcher adds what torchrun saw - its pid, host, signal and phase - in one
    line and in the report's notes."""
    env = dict(cli_env, DISTDIAG_TEST_DIE_AT_START="1")
    env["PYTHONPATH"] = str(HERE / "die_at_start") + os.pathsep + env["PYTHONPATH"]
    out = _run(["--probes", "env", "--launch", "torchrun"], env, tmp_path)
    assert out.returncode == 3, out.stderr[-2000:]
    (line,) = _lines(out.stderr)
    assert "rank 1 (pid " in line and " on host " in line and "ended first (killed by SIGKILL) while importing" in line, line
    report = json.loads((tmp_path / "distdiag-report.json").read_text())
    assert report["exit_code"] == 3 and "rank 1 lost" in report["summary"], report["summary"]
    assert any("killed by SIGKILL" in note for note in report["notes"]), report["notes"]


@pytest.mark.torchrun
@pytest.mark.timeout(180)
def test_a_killed_agent_leaves_no_rank_of_the_check_running(cli_env, tmp_path):
    """torchrun's agent SIGKILLed mid-probe: its ranks, each in a session of its own, would run
    on orphaned until their deadline. The launcher ends them, as `distdiag watch` does, says so
    in one line and exits 3 with a report saying why. (The agent hosted the job's store: a rank
    whose sentinel saw the store go first leaves by itself with exit 3, and where every rank did
    so before the launcher looked there is nobody to end, and its line says torchrun was ended.)"""
    env = dict(cli_env, DISTDIAG_INJECT="sleep:collectives:1:seconds=90")
    proc, root = _start(["--probes", "env,collectives", "--timeout-s", "120"], env, tmp_path)
    seen, agent = [], []
    try:
        seen = _wait_workers(proc, root, connected=True)
        agent = root.children()
        time.sleep(1)
        agent[0].kill()
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 3, err[-2000:]
        said = [line for line in _lines(err) if "agent was killed by signal 9" in line]
        left_alone = "lost the job's store" in err and any(
            line.startswith("distdiag: error: torchrun was ended by signal 9") for line in _lines(err))
        assert (said and said[0].endswith("were ended")) or left_alone, err[-2000:]
        gone, alive = psutil.wait_procs(seen, timeout=30)
        assert alive == [], f"left behind: {[p.pid for p in alive]}"
        assert json.loads((tmp_path / "distdiag-report.json").read_text())["exit_code"] == 3
    finally:
        _cleanup([*seen, *agent, root])
        if proc.poll() is None:
            proc.kill()
