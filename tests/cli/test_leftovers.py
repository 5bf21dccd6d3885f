"""A PASS stays a PASS when the user's target leaves a non-daemon thread or a child process
running, or changes directory: the report and one line say what outlived the verdict, the
leftovers are ended, the exit code is the verdict's. Real runs under `distdiag check` (ranks
forked by torchrun's agent) and `torchrun -m distdiag.check`, with a rank that really fails
after the verdict as the twin that must still exit 3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

HERE = Path(__file__).resolve().parent

TARGET = '''
import multiprocessing, os, subprocess, sys, threading, time

KIND, PIDS, AWAY = {kind!r}, {pids!r}, {away!r}


def _note(pid):
    with open(PIDS, "a") as f:
        f.write(f"{{pid}}\\n")


if KIND == "thread":
    threading.Thread(target=time.sleep, args=(120,), name="user-sleeper").start()
elif KIND == "popen":
    _child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    _note(_child.pid)
elif KIND == "fork":
    _pid = os.fork()
    if _pid == 0:
        time.sleep(120)
        os._exit(0)
    _note(_pid)
elif KIND == "mp":
    _proc = multiprocessing.Process(target=time.sleep, args=(120,))
    _proc.start()
    _note(_proc.pid)
elif KIND == "chdir":
    os.chdir(AWAY)


def build_model():
    import torch

    return torch.nn.Linear(2, 2)
'''

LINE = "what the user's code left behind at the verdict (exit 0 stands)"
SAID = {
    "thread": "a non-daemon thread 'user-sleeper' still running at the end; ended",
    "popen": "a child process (pid",
    "fork": "a child process (pid",
    "mp": "a child process (pid",
    "chdir": "the working directory was changed to",
}


def _command(launch: str, target: Path) -> list[str]:
    args = ["--probes", "env", "--quiet", "--target", str(target)]
    if launch == "check":
        return [sys.executable, "-m", "distdiag", "check", "--nproc-per-node", "2", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "distdiag.check", *args]


def _run(launch: str, kind: str, tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, list[int]]:
    pids, away = tmp_path / "pids.txt", tmp_path / "elsewhere"
    away.mkdir()
    target = tmp_path / "target.py"
    target.write_text(TARGET.format(kind=kind, pids=str(pids), away=str(away)))
    try:
        out = subprocess.run(_command(launch, target), env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=150, stdin=subprocess.DEVNULL)
    finally:
        left = [int(p) for p in pids.read_text().split()] if pids.exists() else []
    return out, left


def _still_running(pids: list[int]) -> list[int]:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(procs, timeout=10)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    for p in alive:
        p.kill()
    return [p.pid for p in alive]


@pytest.mark.torchrun
@pytest.mark.timeout(200)
@pytest.mark.parametrize(("launch", "kind"), [
    ("check", "thread"), ("check", "popen"), ("check", "fork"), ("check", "mp"), ("check", "chdir"), ("check", "none"),
    ("torchrun", "thread"), ("torchrun", "fork"), ("torchrun", "chdir"), ("torchrun", "none"),
])
def test_what_outlives_a_pass_is_said_and_ended_and_the_pass_stands(cli_env, tmp_path, launch, kind):
    """A target that leaves a thread or child running (or changed directory): exit 0, said, ended."""
    out, left = _run(launch, kind, tmp_path, cli_env)
    assert _still_running(left) == [], f"left running after the check: {left}"
    assert "verdict: PASS (exit 0)" in out.stdout, out.stderr[-3000:]
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "distdiag-report.json").read_text())
    assert report["exit_code"] == 0 and report["verdict"] == "pass"
    notes = [n for n in report.get("notes", []) if n.startswith("after the verdict")]
    if kind == "none":
        assert notes == [] and LINE not in out.stderr, "a target that leaves nothing behind is not told about"
        return
    assert LINE in out.stderr, out.stderr[-3000:]
    for rank in (0, 1):
        assert any(n.startswith(f"after the verdict, rank {rank}: {SAID[kind]}") for n in notes), notes


@pytest.mark.torchrun
@pytest.mark.timeout(200)
def test_a_rank_that_dies_after_the_verdict_is_still_exit_3_beside_a_leftover_thread(cli_env, tmp_path):
    """Twin: the same leftover thread, and rank 1 SIGKILLed as it leaves after the PASS: exit 3, said."""
    env = dict(cli_env, DISTDIAG_TEST_DIE_AFTER_VERDICT="1")
    env["PYTHONPATH"] = str(HERE / "die_after_verdict") + os.pathsep + env["PYTHONPATH"]
    out, left = _run("check", "thread", tmp_path, env)
    assert "verdict: PASS" in out.stdout, out.stderr[-3000:]
    assert out.returncode == 3, out.stderr[-3000:]
    assert "a rank failed after the verdict; exiting 3" in out.stderr
    assert json.loads((tmp_path / "distdiag-report.json").read_text())["exit_code"] == 3


@pytest.mark.torchrun
@pytest.mark.timeout(200)
def test_a_target_that_changes_directory_and_has_no_hook_is_still_bad_input(cli_env, tmp_path):
    """A target that chdirs at import and defines no hook: exit 2 with the bad-input report where
    it belongs (it used to land in the new directory, and distdiag check exited 3 for want of it)."""
    (tmp_path / "elsewhere").mkdir()
    target = tmp_path / "target.py"
    target.write_text(f"import os\nos.chdir({str(tmp_path / 'elsewhere')!r})\n")
    out = subprocess.run(_command("check", target), env=cli_env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=150, stdin=subprocess.DEVNULL)
    assert out.returncode == 2, out.stderr[-3000:]
    report = json.loads((tmp_path / "distdiag-report.json").read_text())
    assert report["exit_code"] == 2 and report["outcome"] == "bad_input"
    assert not (tmp_path / "elsewhere" / "distdiag-report.json").exists()
