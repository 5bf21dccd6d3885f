"""The ranks of a node share one stderr: their lines must not run together.

CI caught two ranks' "distdiag: error: ..." lines joined into one under an unbuffered Python
(PYTHONUNBUFFERED=1, as many job launchers set): print() writes the text and the newline as two
writes, and another rank's line can land between them.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

WRITERS = 4
LINES = 2000
PAD = "x" * 100


def _lines_from_writers(code: str) -> list[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    read, write = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-c", code, str(k)], stderr=write, env=env) for k in range(WRITERS)]
    os.close(write)
    data = b""
    while chunk := os.read(read, 1 << 16):
        data += chunk
    os.close(read)
    for proc in procs:
        assert proc.wait(timeout=30) == 0
    return data.decode().splitlines()


def test_lines_of_concurrent_writers_stay_whole():
    code = (
        "import sys\nfrom distdiag.errors import print_line\n"
        f"for i in range({LINES}): print_line(f'rank{{sys.argv[1]}} line {{i}} {PAD}')"
    )
    lines = _lines_from_writers(code)
    torn = [line for line in lines if line.count("rank") != 1 or not line.endswith(PAD)]
    assert len(lines) == WRITERS * LINES and not torn, torn[:3]
