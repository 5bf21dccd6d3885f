"""torchrun as the launcher's child: started in a session of its own, our signals forwarded to
it (a second one, or a job the JobWatch sees cannot end by itself, kills it), its ranks left
orphaned by a killed agent ended, its stderr collected, and the training command exec'd.

torchrun exits 1 for any failed worker and prints its own traceback (docs/facts.md): the
front ends (check.py, gate.py, watch.py) take the exit code from this run's report instead
(exit_code.py) and keep torchrun's noise out of the user's way (stderr.py; all of it with
DISTDIAG_DEBUG=1).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Protocol

from distdiag.errors import print_line
from distdiag.launcher.jobwatch import JobWatch, die_with_parent, kill_tree
from distdiag.launcher.stderr import collect, filter_torchrun_stderr

__all__ = ["run_forwarding_signals", "run_filtered", "exec_command", "STOP_WAIT_S", "JobEnd", "Launched"]


STOP_WAIT_S = 60.0
"""After forwarding SIGTERM, how long torchrun gets to stop its workers (it gives them 30 s
before its own SIGKILL) before the launcher kills what is left of the job."""


@dataclass
class JobEnd:
    """How the launched job ended, as the launcher saw it."""

    rc: int
    """torchrun's exit code (negative: the signal that ended it)."""
    stopped_by: str | None = None
    """The signal the launcher got (SIGINT: the user's Ctrl-C), if any."""
    killed_why: str | None = None
    """Why the launcher killed the job itself (JobWatch), if it did."""
    notes: list[str] = field(default_factory=list)
    """What the launcher did to single ranks (a rank stopped after the verdict, ended)."""
    orphans: list[int] = field(default_factory=list)
    """The ranks left running after torchrun's agent was killed by a signal (none of ours),
    which the launcher then ended: nothing else would have."""


class Launched(Protocol):
    """What run_forwarding_signals reads of a launch (launch.py's Launch)."""

    watch: JobWatch

    def mark_cancelled(self, signal_name: str) -> None: ...


def run_forwarding_signals(
    cmd: list[str],
    env: dict[str, str],
    on_start: Callable[[subprocess.Popen[str]], None] | None = None,
    launch: Launched | None = None,
    **popen: Any,
) -> JobEnd:
    """Run torchrun, passing our SIGTERM/SIGINT on to it, until it ends.

    torchrun runs in a session of its own, so that it gets one signal, ours, not also the
    terminal's Ctrl-C; it gets SIGTERM should this process die (jobwatch.die_with_parent).
    SIGINT goes on as SIGTERM: the check's sentinels turn SIGTERM into a 'terminated' report,
    while SIGINT would only interrupt a rank's main thread once its collective returned. After
    a signal the wait is bounded (STOP_WAIT_S); a second signal kills the job at once; so does
    `launch`'s JobWatch when it sees a job nobody inside can end (jobwatch.py).
    """
    watch = launch.watch if launch is not None else None
    got: list[int] = []
    started: list[subprocess.Popen[str]] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        got.append(signum)
        if launch is not None and len(got) == 1:
            launch.mark_cancelled(signal.Signals(signum).name)
        if not started:
            return  # not launched yet: forwarded right after the launch
        if len(got) > 1:
            kill_tree(started[0].pid)
            return
        try:
            started[0].send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass

    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, forward)
    killed_why = None
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=die_with_parent(), **popen)
        started.append(proc)
        if got:
            proc.send_signal(signal.SIGTERM)  # the marker was left by forward() already
        if on_start is not None:
            on_start(proc)
        killed_why = _wait_bounded(proc, got, watch)
        rc = proc.wait(timeout=30)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    name = signal.Signals(got[0]).name if got else None
    # torchrun's agent killed by a signal (not by us: kill_tree ends the ranks too) leaves its
    # ranks running, each in a session of its own (docs/facts.md): a training job would run on
    orphans = watch.end_orphans() if watch is not None and rc < 0 and killed_why is None else []
    return JobEnd(rc, name, killed_why, list(watch.ended) if watch is not None else [], orphans)


def _wait_bounded(proc: subprocess.Popen[str], got: list[int], watch: JobWatch | None) -> str | None:
    """Wait for torchrun to end; kill the job (returning why) when it outlives a signal by
    STOP_WAIT_S, or when `watch` sees it cannot end by itself."""
    forwarded_at: float | None = None
    while True:
        try:
            proc.wait(timeout=0.5)
            return None
        except subprocess.TimeoutExpired:
            pass
        if got and forwarded_at is None:
            forwarded_at = time.monotonic()
        why = None
        if forwarded_at is not None and time.monotonic() - forwarded_at > STOP_WAIT_S:
            why = f"torchrun did not stop within {STOP_WAIT_S:g}s of SIGTERM"
        elif watch is not None:
            why = watch.tick(proc.pid)
        if why is not None:
            print_line(f"distdiag: {why}; killing the job")
            kill_tree(proc.pid)
            return why


def run_filtered(cmd: list[str], env: dict[str, str], launch: Launched) -> tuple[JobEnd, list[str]]:
    """run_forwarding_signals with torchrun's stderr collected and, once the job ended, written
    through filter_torchrun_stderr (its log lines, the OMP_NUM_THREADS banner and its
    ChildFailedError traceback dropped, the ranks' own lines kept): `distdiag check` and
    `distdiag gate` alike. DISTDIAG_DEBUG=1 shows all of it live. A cancelled run is said in
    one line (exit_code.exit_code_after_run); the ranks' and torchrun's lines about the signal
    are noise then. Returns how the job ended and every stderr line."""
    debug = os.environ.get("DISTDIAG_DEBUG") == "1"
    lines: list[str] = []
    pumps: list[threading.Thread] = []

    def pump_stderr(proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        thread = threading.Thread(target=collect, args=(proc.stderr, lines, debug), name="distdiag-stderr", daemon=True)
        thread.start()
        pumps.append(thread)

    end = run_forwarding_signals(cmd, env, pump_stderr, launch, stderr=subprocess.PIPE, text=True, bufsize=1)
    for thread in pumps:
        thread.join(timeout=5)
    if not debug and not end.stopped_by:
        sys.stderr.writelines(filter_torchrun_stderr(lines))
    return end, lines


def exec_command(command: list[str]) -> int:
    """Become the training command (output flushed first); 127 / 126 with one line when it is
    missing or not executable, as a shell says."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(command[0], command)
    except FileNotFoundError:
        sys.stderr.write(f"distdiag: error: the training command {command[0]!r} was not found\n")
        return 127
    except PermissionError:
        sys.stderr.write(f"distdiag: error: the training command {command[0]!r} is not executable\n")
        return 126
    return 0  # pragma: no cover - execvp does not return
