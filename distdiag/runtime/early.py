"""What a rank does before it imports torch: a stop signal is noted, not obeyed at once.

Importing torch and the check takes seconds (more on a loaded node), and torchrun SIGTERMs
every worker the moment one fails: a rank still importing died of it on the spot, so a rank
lost at import under `torchrun -m distdiag.check` left no report at all, only torchrun's
summary. From the first line of `python -m distdiag.check` (distdiag/check/__main__.py),
SIGTERM and SIGINT are noted instead (and told to the rank's phase note, for the writer of the
report to read) and written to a wakeup pipe that `install_sigterm_wakeup` in
distdiag/runtime/sentinel.py hands to the sentinel: it acts on them once it starts, and the
run ends the way it ends for a signal at any later point, with a report written by a
survivor that names the rank that was lost. torchrun SIGKILLs a worker 30 s after its SIGTERM, which bounds the wait.

Stdlib only: it runs before torch is imported.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

__all__ = ["defer_stop_signals", "deferred", "wakeup_pipe", "STOP_SIGNALS"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_pending: list[int] = []


def defer_stop_signals(on_signal: Callable[[str], None] | None = None) -> None:
    """Note SIGTERM and SIGINT from now on (`on_signal(name)` is told each); call from the main
    thread. The sentinel's own handling replaces this one when it starts."""

    def _noted(signum: int, frame: object) -> None:
        if signum not in _pending:
            _pending.append(signum)
        if on_signal is not None:
            try:
                on_signal(signal.Signals(signum).name)
            except Exception:  # noqa: BLE001 - a note is evidence, never a reason to die
                pass

    for sig in STOP_SIGNALS:
        signal.signal(sig, _noted)
    # The C-level handler writes each signal's number to this pipe the moment it arrives; the
    # Python-level one above runs only when the main thread next runs Python code, which may be
    # after the sentinel's handling replaced it: the pipe, which the sentinel reads, keeps it.
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    _pipe[:] = [read_fd, write_fd]


_pipe: list[int] = []


def wakeup_pipe() -> tuple[int, int] | None:
    """(read fd, write fd) of the wakeup pipe made here, holding the signals that came since."""
    return (_pipe[0], _pipe[1]) if _pipe else None


def deferred() -> list[int]:
    """The stop signals noted so far (their numbers), in order of arrival."""
    return list(_pending)
