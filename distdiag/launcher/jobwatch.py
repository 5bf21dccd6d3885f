"""The launcher's view of the job it started: torchrun's agent and the ranks under it.

The ranks watch each other (the check's sentinels, the training job's hang watchdog), but some
ends leave nobody inside the job able to act, and the job then waited forever: the agent
SIGSTOPped (its store stops answering every rank), a rank stopped before anything inside
watched it (a training rank before its watchdog armed), a rank stopped after the check's
verdict (the agent waits for it), a forked rank that left with 0 without handing torchrun its
result (the agent waits for it), the agent killed (its ranks run on, orphaned). `JobWatch.tick`,
called by the launcher twice a second, sees these from outside and names the reason to end
the job; `kill_tree` ends it without leaving a process behind; `die_with_parent` makes the
agent end the job when the launcher itself is killed.

What counts as wrong depends on the job (`JobRules`): the check is over in minutes and its
ranks are watched from their first line (`CHECK_RULES`); a training job may run for days, its
ranks are watched only once their watchdog armed, and torchrun may restart them
(`training_rules`): no rule there limits how long a healthy job runs.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from distdiag.launcher.ranks import ARMED_PHASE

__all__ = [
    "JobWatch", "JobRules", "CHECK_RULES", "training_rules", "kill_tree", "die_with_parent", "AGENT_STOPPED_S",
    "RANK_STOPPED_S", "GONE_S", "LINGER_S", "ARMED_PHASE",
]

AGENT_STOPPED_S = 5.0
"""How long torchrun's agent may stay stopped (SIGSTOP, a debugger) during the check before the
launcher ends the job: its store answers nobody meanwhile, so no rank can even report."""
RANK_STOPPED_S = 2.0
"""After the verdict: how long a rank may stay stopped before the launcher ends it (the ranks
themselves report a rank stopped before the verdict; after it, only the agent waits on it)."""
GONE_S = 10.0
"""How long the agent may go on after a rank ended without it noticing - every rank gone
before the verdict, or any rank gone after it (a forked rank that left with 0 before handing
its result leaves torchrun's agent waiting forever)."""
LINGER_S = 30.0
"""After the verdict, how long the job may take to end at all (the ranks leave within
seconds: distdiag.check.finish.LEAVE_WAIT_S)."""


@dataclass(frozen=True)
class JobRules:
    """When the launcher ends a job from outside (None: never for that reason)."""

    agent_stopped_s: float
    """torchrun's agent stopped (SIGSTOP, a debugger) for longer than this."""
    rank_stopped_s: float | None
    """A rank nothing inside watches yet (not noted ARMED_PHASE) stopped for longer than this.
    None where the ranks watch each other from their first line (the check's sentinels)."""
    all_gone_s: float | None
    """Every rank ended, the agent still running this much later. None where the agent is
    torchrun's own, which notices its workers' exits and may restart them: between two
    attempts no rank is alive for as long as the rendezvous takes."""
    after_verdict: bool
    """The check's rules after its verdict: a stopped rank is killed, a rank gone without the
    agent ending the job, or a job lingering LINGER_S, ends it."""


CHECK_RULES = JobRules(agent_stopped_s=AGENT_STOPPED_S, rank_stopped_s=None, all_gone_s=GONE_S, after_verdict=True)


def training_rules(timeout_s: float) -> JobRules:
    """`distdiag watch`'s rules for a job with hang watchdog timeout `timeout_s`: a stopped agent
    or a stopped rank not yet armed ends the job once it has been stopped as long as the
    watchdog would take to call a hang, and 10 s more; nothing ends a job for running long."""
    return JobRules(agent_stopped_s=timeout_s + 10.0, rank_stopped_s=timeout_s + 10.0, all_gone_s=None,
                    after_verdict=False)


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` that has the kernel SIGTERM the launched process when this one dies
    (Linux's PR_SET_PDEATHSIG): torchrun's agent runs in a session of its own, so without it
    a SIGKILLed launcher left the whole job running. The agent takes SIGTERM as a request to
    stop its ranks, which report the run as terminated. None where prctl is missing."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the line above: too late for the kernel
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def kill_tree(pid: int, *, reap_root: bool = False) -> None:
    """SIGKILL a process and every process under it. torchrun's workers run in sessions of
    their own (docs/facts.md), so killing torchrun alone would orphan them: collect them first.
    The root is not waited for unless `reap_root`: when it is our child, subprocess must reap
    it itself (psutil reaping it first made Popen.wait report exit 0 for a killed job)."""
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.Error:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs if reap_root else procs[:-1], timeout=10)


def _status(proc: psutil.Process | None) -> str:
    if proc is None:
        return psutil.STATUS_DEAD
    try:
        return proc.status()
    except psutil.Error:
        return psutil.STATUS_DEAD


def _stopped(status: str) -> bool:
    return status in (psutil.STATUS_STOPPED, getattr(psutil, "STATUS_TRACING_STOP", "tracing-stop"))


def _gone(status: str) -> bool:
    return status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


class JobWatch:
    """Looks at the job from outside; `tick` returns why the whole job must end, or None.

    `verdict_reached` says whether a rank has noted the check's verdict (launcher/ranks.py);
    `noted` gives the ranks' own notes by pid ({pid: phase}): a rank that lived less than a tick
    is known by them, not seen among the agent's children, and a training rank says there
    that its watchdog armed."""

    def __init__(
        self,
        verdict_reached: Callable[[], bool] = lambda: False,
        noted: Callable[[], dict[int, str]] = dict,
        clock: Callable[[], float] = time.monotonic,
        rules: JobRules = CHECK_RULES,
    ) -> None:
        self.verdict_reached = verdict_reached
        self.noted = noted
        self.clock = clock
        self.rules = rules
        self.ranks: dict[int, psutil.Process | None] = {}
        self.phases: dict[int, str] = {}
        self.gone_at: dict[int, float] = {}
        self.stopped_at: dict[int, float] = {}
        self.verdict_at: float | None = None
        self.ended: list[str] = []
        """What the watch did to single ranks (one line each), for the launcher to say."""

    def _look_for_ranks(self, agent: psutil.Process) -> None:
        try:
            children = agent.children()
        except psutil.Error:
            return
        for child in children:
            if child.pid in self.ranks:
                continue
            try:
                if "resource_tracker" in " ".join(child.cmdline()):
                    continue
            except psutil.Error:
                continue
            self.ranks[child.pid] = child
        self.phases = self.noted()
        for pid in self.phases:
            if pid not in self.ranks:
                try:
                    self.ranks[pid] = psutil.Process(pid)
                except psutil.Error:
                    self.ranks[pid] = None  # gone before we looked

    def _since(self, table: dict[int, float], key: int, now: float, on: bool) -> float:
        """How long a condition has held for `key` (0 when it does not hold)."""
        if not on:
            table.pop(key, None)
            return 0.0
        return now - table.setdefault(key, now)

    def tick(self, agent_pid: int) -> str | None:
        now = self.clock()
        try:
            agent = psutil.Process(agent_pid)
        except psutil.Error:
            return None
        agent_status = _status(agent)
        if _gone(agent_status):
            return None
        limit = self.rules.agent_stopped_s
        if self._since(self.stopped_at, agent_pid, now, _stopped(agent_status)) > limit:
            return (f"torchrun's agent (pid {agent_pid}) has been stopped (SIGSTOP or a debugger) for over "
                    f"{limit:g}s: the job's store answers no rank")
        self._look_for_ranks(agent)
        if self.verdict_at is None and self.rules.after_verdict and self.verdict_reached():
            self.verdict_at = now
        states = {pid: _status(proc) for pid, proc in self.ranks.items()}
        gone_for = {pid: self._since(self.gone_at, pid, now, _gone(s)) for pid, s in states.items()}
        if self.verdict_at is not None:
            return self._after_verdict(now, states, gone_for)
        unwatched = self.rules.rank_stopped_s
        if unwatched is not None:
            for pid, status in states.items():
                watched = self.phases.get(pid) == ARMED_PHASE
                if self._since(self.stopped_at, pid, now, _stopped(status) and not watched) > unwatched:
                    return (f"a rank (pid {pid}) has been stopped (SIGSTOP or a debugger) for over "
                            f"{unwatched:g}s and no watchdog reported it (it stopped before arming)")
        gone_s = self.rules.all_gone_s
        if gone_s is not None and states and all(_gone(s) for s in states.values()) and min(gone_for.values()) > gone_s:
            return (f"every rank has ended but torchrun's agent (pid {agent_pid}) has still not, {gone_s:g}s "
                    "later (a rank left with exit 0 without handing torchrun its result?)")
        return None

    def orphans(self) -> list[int]:
        """The ranks still alive: after torchrun's agent was killed they run on without it."""
        out = []
        for pid, proc in self.ranks.items():
            if proc is not None and not _gone(_status(proc)):
                out.append(pid)
        return out

    def end_orphans(self) -> list[int]:
        """Kill the ranks left alive (their agent is gone; nothing else would end them)."""
        left = self.orphans()
        for pid in left:
            _kill(self.ranks[pid])
        return left

    def _after_verdict(self, now: float, states: dict[int, str], gone_for: dict[int, float]) -> str | None:
        assert self.verdict_at is not None
        for pid, status in states.items():
            if self._since(self.stopped_at, pid, now, _stopped(status)) > RANK_STOPPED_S:
                self.ended.append(f"a rank (pid {pid}) was stopped after the verdict; it was killed")
                _kill(self.ranks[pid])
                self.stopped_at.pop(pid, None)
        late = [pid for pid, t in gone_for.items() if t > GONE_S]
        if late:
            return (f"a rank (pid {late[0]}) ended after the verdict but torchrun did not end the job "
                    f"{GONE_S:g}s later")
        if now - self.verdict_at > LINGER_S:
            return f"the job did not end within {LINGER_S:g}s of the verdict"
        return None


def _kill(proc: psutil.Process) -> None:
    try:
        proc.kill()
    except psutil.Error:
        pass
