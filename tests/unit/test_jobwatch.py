"""The launcher's job watch (distdiag/launcher/jobwatch.py) on real processes, with a clock of
the test's own: the check's rules (minutes) and a training job's (days) side by side. The
'agent' is a Python process with one sleeping child, its 'rank'."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from distdiag.launcher.jobwatch import CHECK_RULES, JobWatch, training_rules
from distdiag.launcher.ranks import ARMED_PHASE

AGENT = "import subprocess, time\np = subprocess.Popen(['sleep', '120'])\nprint(p.pid, flush=True)\ntime.sleep(120)\n"


@pytest.fixture
def job():
    agent = subprocess.Popen([sys.executable, "-c", AGENT], stdout=subprocess.PIPE, text=True)
    assert agent.stdout is not None
    rank = int(agent.stdout.readline())
    yield agent.pid, rank
    for pid in (rank, agent.pid):
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait(timeout=10)


def _wait_stopped(pid: int) -> None:
    """SIGSTOP takes effect asynchronously: the first tick must already see it."""
    import time

    deadline = time.monotonic() + 10
    while psutil.Process(pid).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
        time.sleep(0.01)


def _watch(rules, noted=None):
    now = [0.0]
    watch = JobWatch(noted=lambda: dict(noted or {}), clock=lambda: now[0], rules=rules)
    return watch, now


@pytest.mark.timeout(60)
def test_a_healthy_training_job_is_never_ended_for_running_long(job):
    agent, rank = job
    watch, now = _watch(training_rules(3.0), {rank: ARMED_PHASE})
    for t in (0.0, 60.0, 3600.0, 7 * 24 * 3600.0):  # a week
        now[0] = t
        assert watch.tick(agent) is None
    assert list(watch.ranks) == [rank]


@pytest.mark.timeout(60)
def test_a_rank_stopped_before_its_watchdog_armed_ends_the_job_an_armed_one_is_left_to_its_peers(job):
    agent, rank = job
    os.kill(rank, signal.SIGSTOP)
    _wait_stopped(rank)
    unarmed, now = _watch(training_rules(3.0), {rank: "running the training script, its watchdog not armed yet"})
    armed, now_armed = _watch(training_rules(3.0), {rank: ARMED_PHASE})
    for t in (0.0, 12.0):
        now[0] = now_armed[0] = t
        assert unarmed.tick(agent) is None and armed.tick(agent) is None
    now[0] = now_armed[0] = 14.0
    why = unarmed.tick(agent)
    assert why is not None and f"a rank (pid {rank}) has been stopped" in why and "over 13s" in why, why
    now_armed[0] = 3600.0
    assert armed.tick(agent) is None
    # the check's ranks watch each other from their first line: before its verdict, not the launcher's to end
    check, now_check = _watch(CHECK_RULES)
    for t in (0.0, 3600.0):
        now_check[0] = t
        assert check.tick(agent) is None


@pytest.mark.timeout(60)
def test_a_stopped_agent_ends_the_check_in_seconds_and_a_training_job_after_its_hang_timeout(job):
    agent, _rank = job
    os.kill(agent, signal.SIGSTOP)
    _wait_stopped(agent)
    check, now_check = _watch(CHECK_RULES)
    training, now = _watch(training_rules(300.0))
    for t in (0.0, 4.0):
        now_check[0] = now[0] = t
        assert check.tick(agent) is None and training.tick(agent) is None
    now_check[0] = now[0] = 6.0
    assert "has been stopped (SIGSTOP or a debugger) for over 5s" in (check.tick(agent) or "")
    assert training.tick(agent) is None
    now[0] = 311.0
    assert "has been stopped (SIGSTOP or a debugger) for over 310s" in (training.tick(agent) or "")


@pytest.mark.timeout(60)
def test_every_rank_gone_ends_the_check_not_a_training_job_that_torchrun_may_restart(job):
    agent, rank = job
    check, now_check = _watch(CHECK_RULES)
    training, now = _watch(training_rules(3.0))
    assert check.tick(agent) is None and training.tick(agent) is None  # both see the rank
    os.kill(rank, signal.SIGKILL)  # a zombie: the 'agent' never reaps it
    psutil.wait_procs([psutil.Process(rank)], timeout=5)
    for t in (1.0, 5.0):
        now_check[0] = now[0] = t
        assert check.tick(agent) is None and training.tick(agent) is None
    now_check[0] = now[0] = 12.0
    assert "every rank has ended but torchrun's agent" in (check.tick(agent) or "")
    now[0] = 3600.0
    assert training.tick(agent) is None


def test_another_nodes_copy_of_a_report_carries_this_nodes_launch_id(monkeypatch):
    """Each node's launcher takes only a report with its own launch id: the hang report's copy a
    node keeps (written by a rank of another node) is stamped with this node's; without a
    launcher it is kept as it came."""
    import json

    from distdiag.launcher.ranks import LAUNCH_ID_ENV, with_this_launch_id
    from distdiag.report.model import Report

    text = Report(world_size=2, exit_code=3, verdict="fail", launch_id="node-0s").to_json()
    monkeypatch.delenv(LAUNCH_ID_ENV, raising=False)
    assert with_this_launch_id(text) == text
    monkeypatch.setenv(LAUNCH_ID_ENV, "node-1s")
    copy = with_this_launch_id(text)
    data, original = json.loads(copy), json.loads(text)
    assert data["launch_id"] == "node-1s" and data["exit_code"] == 3
    assert copy.startswith("{\n") and list(data) == list(original)  # every key, in its place
    assert {k: v for k, v in data.items() if k != "launch_id"} == {k: v for k, v in original.items() if k != "launch_id"}
    assert with_this_launch_id("not json") == "not json"
