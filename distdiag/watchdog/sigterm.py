"""SIGTERM under the zero-code wrapper: report the rank that left before the launcher ends the rest.

When a worker dies (SIGKILL by the OOM killer, a segfault) torchrun sends SIGTERM to every
other worker within its monitor interval, long before any timeout: under `torchrun -m
distdiag.watch` the survivors used to die by that signal with no report, and the user saw only
torchrun's "ChildFailedError". The wrapper (distdiag/watch.py) therefore takes SIGTERM once the
watchdog is armed, the way the check's sentinel does (distdiag/runtime/sentinel.py): a no-op
Python handler keeps the process alive, and the C-level handler writes the signal to a wakeup
pipe that a thread of ours reads, whatever the main thread is blocked in (a gloo collective
never returns to Python). The watchdog thread then declares a `terminated` incident: every rank
posts its snapshot, the writer names the ranks that posted none (the one that died) and writes
the report; if every rank answered (a job cancelled from outside), no report is written. Either
way the process ends: exit 3 after a report, 143 (128 + SIGTERM, what a shell shows for a
process SIGTERM ended) otherwise, and at the latest TERM_GRACE_S after the signal.

Left alone: a SIGTERM handler the user's script installed (before or after arming: theirs wins,
e.g. a checkpoint on preemption), a wakeup fd someone else set, and the in-code HangWatchdog
(a library must not take its host program's signals).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["TermWatch", "TERM_GRACE_S", "EXIT_SIGTERM"]

log = logging.getLogger("distdiag.watchdog")

TERM_GRACE_S = 15.0
"""After SIGTERM, the longest this process stays alive while the incident is handled (torchrun
sends SIGKILL 30 s after its SIGTERM; Slurm's default KillWait is 30 s too)."""
EXIT_SIGTERM = 128 + int(signal.SIGTERM)
"""The exit code of a process that leaves because of SIGTERM without a report."""


def _noop(signum: int, frame: Any) -> None:
    """The Python-level handler: keeps the process alive; the wakeup pipe carries the signal."""


class TermWatch:
    """Owns SIGTERM for the wrapper: `received` is set when it came (and is still ours)."""

    def __init__(self) -> None:
        self.received = threading.Event()
        self._read_fd = -1
        self._alive: Callable[[], bool] = lambda: True

    def install(self, watcher_alive: Callable[[], bool]) -> bool:
        """Take SIGTERM (main thread only); False, changing nothing, when it is not ours to take."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
            return False  # the script's own handler (or SIG_IGN): its choice
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        try:
            previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:
            os.close(read_fd)
            os.close(write_fd)
            return False
        if previous != -1:  # someone else's (an event loop's): give it back, stay out
            signal.set_wakeup_fd(previous)
            os.close(read_fd)
            os.close(write_fd)
            return False
        signal.signal(signal.SIGTERM, _noop)
        self._read_fd, self._alive = read_fd, watcher_alive
        threading.Thread(target=self._listen, name="distdiag-sigterm", daemon=True).start()
        return True

    def _listen(self) -> None:
        while True:
            ready, _, _ = select.select([self._read_fd], [], [], 1.0)
            if not ready:
                continue
            try:
                data = os.read(self._read_fd, 512)
            except BlockingIOError:
                continue
            if int(signal.SIGTERM) not in data:
                continue  # another signal with a Python handler (SIGINT): not ours
            if signal.getsignal(signal.SIGTERM) is not _noop:
                return  # the script installed its own handler since: it handles the signal
            self.received.set()
            self._end_at_the_latest()
            return

    def _end_at_the_latest(self) -> None:
        """The watchdog thread ends the process once the incident is handled; if it is gone
        (the script finished) or does not within TERM_GRACE_S, leave from here."""
        from distdiag.runtime.sentinel import flush_and_exit

        end = time.monotonic() + TERM_GRACE_S
        while time.monotonic() < end and self._alive():
            time.sleep(0.1)
        if self._alive():
            log.warning("the incident after SIGTERM took over %.0fs; leaving without it", TERM_GRACE_S)
        flush_and_exit(EXIT_SIGTERM)
