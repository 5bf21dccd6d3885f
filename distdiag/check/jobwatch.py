"""The launcher's view of the job it started: torchrun's agent and the ranks under it.

The ranks watch each other (distdiag.runtime.sentinel), but some ends leave nobody inside the
job able to act, and the job then waited forever (issue 24): the agent SIGSTOPped (its store
stops answering every rank), a rank stopped after the verdict (the agent waits for it), a
forked rank that left with 0 without handing torchrun its result (the agent waits for it).
`JobWatch.tick`, called by the launcher twice a second, sees these from outside and names
the reason to end the job; `kill_tree` ends it without leaving a process behind; and
`die_with_parent` makes the agent end the job when the launcher itself is killed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import psutil

__all__ = ["JobWatch", "kill_tree", "die_with_parent", "AGENT_STOPPED_S", "RANK_STOPPED_S", "GONE_S", "LINGER_S"]

AGENT_STOPPED_S = 5.0
"""How long torchrun's agent may stay stopped (SIGSTOP, a debugger) before the launcher ends
the job: its store answers nobody meanwhile, so no rank can even report."""
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

    `verdict_reached` says whether a rank has noted the verdict (distdiag.check.launched)."""

    def __init__(
        self,
        verdict_reached: Callable[[], bool],
        noted_pids: Callable[[], list[int]] = list,
        clock: Callable[[], float] = time.monotonic,
        rank_stopped_s: float | None = None,
    ) -> None:
        self.verdict_reached = verdict_reached
        self.rank_stopped_s = rank_stopped_s
        """Before the verdict, how long a rank may stay stopped before the job is ended; None
        where the ranks watch each other from the start (the check's sentinels). `distdiag
        watch` sets it: a rank stopped before its watchdog armed (in init_process_group) is
        seen by no peer."""
        self.noted_pids = noted_pids
        """The pids the ranks noted themselves (distdiag.check.launched.note_phase): a rank
        that lived less than a tick is known by them, not seen among the agent's children."""
        self.clock = clock
        self.ranks: dict[int, psutil.Process | None] = {}
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
        for pid in self.noted_pids():
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
        if self._since(self.stopped_at, agent_pid, now, _stopped(agent_status)) > AGENT_STOPPED_S:
            return (f"torchrun's agent (pid {agent_pid}) has been stopped (SIGSTOP or a debugger) for over "
                    f"{AGENT_STOPPED_S:g}s: the job's store answers no rank")
        self._look_for_ranks(agent)
        if self.verdict_at is None and self.verdict_reached():
            self.verdict_at = now
        states = {pid: _status(proc) for pid, proc in self.ranks.items()}
        gone_for = {pid: self._since(self.gone_at, pid, now, _gone(s)) for pid, s in states.items()}
        if self.verdict_at is None:
            if self.rank_stopped_s is not None:
                for pid, status in states.items():
                    if self._since(self.stopped_at, pid, now, _stopped(status)) > self.rank_stopped_s:
                        return (f"a rank (pid {pid}) has been stopped (SIGSTOP or a debugger) for over "
                                f"{self.rank_stopped_s:g}s and no watchdog reported it (it stopped before arming)")
            if states and all(_gone(s) for s in states.values()) and min(gone_for.values()) > GONE_S:
                return (f"every rank has ended but torchrun's agent (pid {agent_pid}) has still not, {GONE_S:g}s "
                        "later (a rank left with exit 0 without handing torchrun its result?)")
            return None
        return self._after_verdict(now, states, gone_for)

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


def _kill(proc: Any) -> None:
    try:
        proc.kill()
    except psutil.Error:
        pass
