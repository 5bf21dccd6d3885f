"""What the user's code left running when a rank's check ends: said, ended, the verdict kept.

A target may start a non-daemon thread, a child process (subprocess, os.fork, multiprocessing)
or change the working directory, at import or in a hook. None of it is the check's business
once the verdict is in, yet each used to turn a PASS into exit 3: a forked rank's worker
wrapper (multiprocessing) joins non-daemon threads and child processes before it exits, so the
job outlived the verdict by as long as they ran and the launcher killed it; a grandchild forked
from a rank kept the agent from seeing that rank end; a relative report path followed the new
working directory. So each rank takes stock as it leaves (`take_stock`), the rank that wrote
the verdict adds what every rank left to the report's notes and says it in one line, each rank
ends its own child processes (`end_children`), and a forked rank leaves without waiting for
its threads (`leave_without_joining`). The exit code stays the verdict's.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    from distdiag.report.model import Report
    from distdiag.runtime.exchange import Exchange

__all__ = ["Leftovers", "take_stock", "end_children", "leave_without_joining", "note_start", "summary_line",
           "note_in_report", "say_leaving", "settle_leftovers", "CHILD_GRACE_S"]

CHILD_GRACE_S = 1.0
"""How long a leftover child process gets after SIGTERM before it is SIGKILLed."""

_start: dict[str, str] = {}


def note_start() -> None:
    """Remember the working directory the check started in (before the target is imported)."""
    try:
        _start["cwd"] = os.getcwd()
    except OSError:
        pass


@dataclass
class Leftovers:
    """What one rank's user code left behind at the end of its check."""

    threads: list[str] = field(default_factory=list)
    """Names of the non-daemon threads still running (besides the main thread)."""
    children: list[psutil.Process] = field(default_factory=list)
    """This process's live descendants."""
    cwd: str | None = None
    """The working directory, when the user's code changed it."""

    def __bool__(self) -> bool:
        return bool(self.threads or self.children or self.cwd)

    def sentences(self) -> list[str]:
        said = [f"a non-daemon thread '{name}' still running at the end; ended" for name in self.threads]
        for child in self.children:
            said.append(f"a child process (pid {child.pid}, {_name(child)}) still running at the end; ended")
        if self.cwd:
            said.append(f"the working directory was changed to {self.cwd} (the report went to the path given at the start)")
        return said


def _name(proc: psutil.Process) -> str:
    try:
        cmd = proc.cmdline()
        return " ".join(cmd)[:80] if cmd else proc.name()
    except psutil.Error:
        return "?"


def take_stock() -> Leftovers:
    """This process's leftovers now (never raises: a look that fails finds nothing)."""
    me = threading.current_thread()
    threads = [t.name for t in threading.enumerate()
               if t is not threading.main_thread() and t is not me and not t.daemon and t.is_alive()]
    children = []
    try:
        for child in psutil.Process().children(recursive=True):
            try:
                if child.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                    children.append(child)
            except psutil.Error:
                continue
    except psutil.Error:
        pass
    cwd = None
    try:
        now = os.getcwd()
        cwd = now if _start.get("cwd") not in (None, now) else None
    except OSError:
        pass
    return Leftovers(threads, children, cwd)


def end_children(children: list[psutil.Process], grace_s: float = CHILD_GRACE_S) -> None:
    """SIGTERM the leftover children, SIGKILL those still there after `grace_s`."""
    for child in children:
        try:
            child.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


def summary_line(by_rank: dict[int, list[str]], code: int) -> str:
    """One line: what outlived the verdict on which rank, and that the exit code stands."""
    parts = [f"rank {r}: {s}" for r, said in sorted(by_rank.items()) for s in said]
    return f"distdiag: what the user's code left behind at the verdict (exit {code} stands): " + "; ".join(parts)


def say_leaving(ex: Exchange) -> Leftovers:
    """This rank is leaving after the verdict: what its user code left, posted before it says
    it leaves (so the writer, once everyone left, has every rank's). Returns it."""
    from distdiag.runtime.keys import Keys

    stock = take_stock()
    if stock:
        ex.post(Keys.LEFTOVER, stock.sentences())
    ex.post(Keys.LEFT, 1)
    return stock


def settle_leftovers(stock: Leftovers, report: Report | None, ex: Exchange, path: str, *, everyone: bool) -> bool:
    """Once the ranks left (`everyone`: all said so): the writer (`report` not None) notes what
    they left; this rank ends its own children. Returns `everyone`."""
    if report is not None:
        note_in_report(report, ex, path)
    end_children(stock.children)
    return everyone


def note_in_report(report: Report, ex: Exchange, path: str) -> None:
    """The verdict's writer, once the ranks left: what their user code left (each rank ends its
    own) goes into the report's notes and one line on stderr; the exit code stays the verdict's."""
    from distdiag.errors import print_line
    from distdiag.report.model import write_report
    from distdiag.runtime.keys import Keys

    if ex.count(Keys.LEFTOVER) <= 0:
        return
    by_rank = {int(r): list(v) for r, v in ex.collect(Keys.LEFTOVER).items() if v}
    if not by_rank:
        return
    report.notes.extend(f"after the verdict, rank {r}: {s}" for r, said in sorted(by_rank.items()) for s in said)
    try:
        write_report(report, path)
    except OSError as exc:
        print_line(f"distdiag: cannot add what outlived the verdict to the report at {path}: {exc.strerror}")
    print_line(summary_line(by_rank, report.exit_code))


def leave_without_joining(code: int) -> None:
    """A forked rank that passed returns to torch's worker wrapper (which hands the agent its
    result), then multiprocessing joins the process's non-daemon threads and children before it
    exits: a thread of the user's would hold the job for as long as it runs. Leave at the first
    of multiprocessing's exit steps instead, once the agent has the result (the wrapper waits
    for the agent to read it before it returns)."""
    from multiprocessing import util

    def _leave() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - leaving anyway
                pass
        os._exit(code)

    util.Finalize(None, _leave, exitpriority=1_000_000)
