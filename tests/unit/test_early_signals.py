"""Before torch is imported, a rank notes SIGTERM and SIGINT instead of dying of them, and the
sentinel's wakeup pipe holds them for when it starts (distdiag/runtime/early.py). Checked in a
child interpreter: the signal handlers are process-wide."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import os, select, signal
from distdiag.runtime.early import defer_stop_signals, deferred
from distdiag.runtime.sentinel import _sigterm_pending, install_sigterm_wakeup

said = []
defer_stop_signals(said.append)
os.kill(os.getpid(), signal.SIG{sig})
print("alive", deferred() == [signal.SIG{sig}], said == ["SIG{sig}"])
install_sigterm_wakeup()  # the sentinel's handling: the pipe made before still holds the signal
print("pending", _sigterm_pending(1.0))
"""


def _child(sig: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", CHILD.format(sig=sig)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_sigterm_while_importing_is_noted_and_handed_to_the_sentinel():
    """SIGTERM before the sentinel exists: the process lives, notes it, and the sentinel reads it."""
    assert _child("TERM") == ["alive", "True", "True", "pending", "SIGTERM"]


def test_sigint_while_importing_is_noted_and_handed_to_the_sentinel():
    """Ctrl-C's SIGINT the same way (no KeyboardInterrupt in the middle of an import)."""
    assert _child("INT") == ["alive", "True", "True", "pending", "SIGINT"]
