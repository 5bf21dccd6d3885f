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
    _root_cause_is(proc.stderr, 1, "rank 1 never entered all_reduce")


def _root_cause_is(stderr: str, rank: int, words: str) -> None:
    """torchrun's "Root Cause (first observed failure)" block names `rank` with distdiag's sentence
    (read from the error file that rank wrote: TORCHELASTIC_ERROR_FILE), not the rank that waited."""
    assert "Root Cause (first observed failure)" in stderr, stderr[-3000:]
    block = stderr.split("Root Cause (first observed failure)", 1)[1]
    assert f"rank      : {rank} (local_rank: {rank})" in block, block
    assert "traceback : distdiag: " in block and words in block, block


@pytest.mark.torchrun
@pytest.mark.timeout(120)
def test_root_cause_is_ours_under_torchrun_check(cli_env, tmp_path):
    """`torchrun -m distdiag.check` with rank 1 hung in the collectives probe: torchrun's root cause is
    rank 1 with the check's verdict sentence (it named rank 0, the waiter, with no message)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "-m", "distdiag.check",
           "--probes", "env,collectives", "--timeout-s", "5"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=dict(cli_env, DISTDIAG_INJECT="hang:collectives:1:after=2"),
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode != 0
    _root_cause_is(proc.stderr, 1, "rank 1 never entered all_reduce")


@pytest.mark.torchrun
@pytest.mark.timeout(120)
def test_root_cause_is_ours_with_the_in_code_watchdog(cli_env, tmp_path):
    """A script with `HangWatchdog` in its code, under plain torchrun, rank 1 blocked: the root cause is
    rank 1 with the watchdog's sentence."""
    script = tmp_path / "train_wd.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parents[2])!r})\n"
        "from tests.faults.watchdog_workers import train\n"
        "sys.exit(train(sys.argv[1:]))\n"
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", str(script),
           "fault=block", "rank=1", "step=2", "timeout=3"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=dict(cli_env), capture_output=True, text=True, timeout=100)
    assert proc.returncode != 0
    _root_cause_is(proc.stderr, 1, "rank 1 never entered all_reduce")


@pytest.mark.torchrun
@pytest.mark.timeout(90)
def test_wrapper_healthy_script_exits_zero_without_report(cli_env, tmp_path):
    proc, _ = _torchrun(cli_env, tmp_path, "fault=slow_step", "rank=1", "step=1", "steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "hang-report").exists()
    # armed: said once for the job (rank 0), with the timeout
    assert proc.stderr.count("distdiag.watch: watchdog armed on 2 rank(s): 3 s without progress is a hang") == 1, proc.stderr


@pytest.mark.timeout(60)
def test_wrapper_bad_input_is_one_line_exit_2(tmp_path):
    for args in (["--timeout-s", "-1", "--", str(SCRIPT)], ["--", str(tmp_path / "missing.py")], []):
        proc = subprocess.run([sys.executable, "-m", "distdiag.watch", *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.strip().count("\n") == 0 and "error" in proc.stderr and "Traceback" not in proc.stderr


MESH = Path(__file__).parent / "mesh_workers.py"


def _mesh_cmd(*words: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone",
        "-m", "distdiag.watch", "--timeout-s", "3", "--", str(MESH), *words, "timeout=3",
    ]


@pytest.mark.torchrun
@pytest.mark.timeout(120)
def test_wrapper_names_a_rank_killed_before_torchrun_ends_the_rest(cli_env, tmp_path):
    """Rank 3 is SIGKILLed in its data loader; torchrun SIGTERMs the survivors at once, before any
    timeout: they take the signal, report the rank that is gone, and only then leave."""
    proc = subprocess.run(_mesh_cmd("kind=tpdp", "fault=kill", "rank=3"), cwd=tmp_path, env=dict(cli_env),
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode != 0
    report = read_report(tmp_path / "hang-report" / "hang-report.json")
    assert report.outcome == "lost_rank", report.summary
    crit = [f for f in report.probe("watchdog").findings if f.severity == "critical"]
    assert crit and crit[0].ranks == [3], [(f.ranks, f.issue) for f in crit]
    assert {r for f in crit for r in f.ranks} == {3}, "the survivors torchrun ended are not blamed"
    # torchrun's root cause is the rank that died (no file of its own), not a survivor's file
    block = proc.stderr.split("Root Cause (first observed failure)", 1)[1]
    assert "rank      : 3 (local_rank: 3)" in block, block


@pytest.mark.torchrun
@pytest.mark.timeout(120)
def test_wrapper_job_cancelled_from_outside_leaves_no_report(cli_env, tmp_path):
    """The healthy twin: the whole job gets SIGTERM (a cancelled job). Every rank answers, so
    there is no report, no rank is blamed, and the job is gone within seconds."""
    proc = subprocess.Popen(_mesh_cmd("kind=tpdp", "steps=100000"), cwd=tmp_path, env=dict(cli_env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(12)  # armed and training (a few hundred steps in on a quiet machine)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.terminate()
        _, err = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (tmp_path / "hang-report").exists(), err[-3000:]
    assert "Connection closed by peer" not in err, "a peer that left at SIGTERM is no traceback of another rank"
