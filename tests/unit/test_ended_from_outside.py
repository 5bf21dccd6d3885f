"""A job ended from outside (SIGTERM to every worker) while one rank was still starting is a
cancellation, not a rank lost at start-up: the silent rank's worker process is alive beside the
writer's, under the same launcher. One that died at start-up is gone (or a zombie) and is still
reported. Real processes: this test plays the launcher, its children the workers."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

_WRITER = """
from distdiag.hang.records import Silence, SilentReason
from distdiag.watchdog.writer import _ended_from_outside
never = Silence(SilentReason.NEVER_CHECKED_IN, "it never checked in")
print(repr(_ended_from_outside({3: never})))
print(repr(_ended_from_outside({})))
"""


def _worker(rank: int, code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, RANK=str(rank)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("starting", [True, False], ids=["still-starting", "died-at-start"])
def test_a_silent_rank_still_starting_under_the_same_launcher_is_a_cancellation(starting):
    sibling = _worker(3, "import time; time.sleep(30)" if starting else "raise SystemExit(1)")
    try:
        if not starting:
            deadline = time.monotonic() + 20
            while sibling.poll() is None and time.monotonic() < deadline:  # reaped: gone, as torchrun reaps it
                time.sleep(0.05)
        out = subprocess.run([sys.executable, "-c", _WRITER], env=dict(os.environ, RANK="0"),
                             capture_output=True, text=True, timeout=50)
        assert out.returncode == 0, out.stderr[-2000:]
        first, second = out.stdout.splitlines()[-2:]
        if starting:
            assert "rank(s) 3 were still starting (alive)" in first, first
        else:
            assert first == "None", first
        assert "every rank answered" in second, second
    finally:
        sibling.kill()
        sibling.wait(10)
