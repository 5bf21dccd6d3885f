"""CPU load beside a test: busy-loop processes with a bounded lifetime, killed on the way out.

The watchdog's healthy twins must stay silent on a saturated machine (issue 24: healthy jobs
were aborted at load 4-6). Each busy process spins in pure Python until its deadline, so a
test that dies early cannot leave one behind for long, and `busy_cpus` kills them all in
`finally` anyway.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["busy_cpus"]

_SPIN = "import time\nend = time.monotonic() + {life}\nwhile time.monotonic() < end:\n    sum(range(1000))\n"


@contextmanager
def busy_cpus(count: int, lifetime_s: float = 120.0) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`count` processes each spinning one CPU for at most `lifetime_s` seconds."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(count):
            procs.append(subprocess.Popen([sys.executable, "-c", _SPIN.format(life=lifetime_s)]))
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(timeout=10)
