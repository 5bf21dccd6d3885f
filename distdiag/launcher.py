"""Run `torchrun ... -m distdiag.check` for the user and return the verdict's exact code.

torchrun exits 1 for any failed worker and prints its own traceback (FACTS.md); this takes
the code from the report the check wrote and keeps torchrun's noise out of the user's way
(all of it is shown with DISTDIAG_DEBUG=1).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

__all__ = ["run_torchrun_check", "filter_torchrun_stderr", "torchrun_command"]

_GLOG = re.compile(r"^([WEIF]\d{4} \d\d:\d\d:\d\d|\*+\s*$|Setting OMP_NUM_THREADS environment variable)")


def torchrun_command(nproc: int, check_args: list[str], torchrun_args: list[str] | None = None) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        *(torchrun_args or []), "-m", "distdiag.check", *check_args,
    ]


def filter_torchrun_stderr(lines: list[str]) -> list[str]:
    """Drop torchrun's log lines and its final ChildFailedError traceback; keep the rest."""
    out: list[str] = []
    held: list[str] = []
    for line in lines:
        if held or line.startswith("Traceback (most recent call last):"):
            held.append(line)
            continue
        if _GLOG.match(line):
            continue
        out.append(line)
    if held and not any("ChildFailedError" in h or "torch/distributed/run.py" in h for h in held):
        out.extend(held)
    return out


def _pump(src: IO[str], sink: list[str], live: bool) -> None:
    for line in src:
        if live and not _GLOG.match(line):
            sys.stderr.write(line)
            sys.stderr.flush()
        sink.append(line)


def run_torchrun_check(
    nproc: int, check_args: list[str], report_path: str, torchrun_args: list[str] | None = None
) -> int:
    """Launch, wait, and return the exit code recorded in the report (3 when none was written)."""
    debug = os.environ.get("DISTDIAG_DEBUG") == "1"
    cmd = torchrun_command(nproc, check_args, torchrun_args)
    started = time.time()
    env = dict(os.environ)
    # torchrun sets OMP_NUM_THREADS=1 for nproc > 1 anyway, with a banner; say it quietly.
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, bufsize=1, env=env)
    lines: list[str] = []
    assert proc.stderr is not None
    pump = threading.Thread(target=_pump, args=(proc.stderr, lines, debug), name="distdiag-stderr", daemon=True)
    pump.start()
    while True:
        try:
            rc = proc.wait()
            break
        except KeyboardInterrupt:  # torchrun got the same SIGINT and stops its workers
            continue
    pump.join(timeout=5)
    if not debug:
        for line in filter_torchrun_stderr(lines):
            sys.stderr.write(line)
    from distdiag.errors import ReportError
    from distdiag.report import read_report

    path = Path(report_path)
    fresh = path.exists() and path.stat().st_mtime >= started - 1
    if fresh:
        try:
            return read_report(path).exit_code
        except ReportError as exc:
            sys.stderr.write(f"distdiag: error: {exc}\n")
            return 3
    if rc == 0:
        return 0
    sys.stderr.write(
        f"distdiag: error: torchrun exited {rc} and no report was written to {path}; "
        "a rank died before the check could report (rerun with DISTDIAG_DEBUG=1 for torchrun's log)\n"
    )
    return 3
