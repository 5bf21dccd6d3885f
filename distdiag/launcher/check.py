"""`distdiag check`'s launch: torchrun (or forkrun.py) with the check on N local ranks, and the
exit code of this run's report."""

from __future__ import annotations

import os
import sys

from distdiag.launcher.argv import torchrun_command
from distdiag.launcher.child import run_filtered
from distdiag.launcher.exit_code import exit_code_after_run
from distdiag.launcher.launch import Launch

__all__ = ["run_torchrun_check"]


def run_torchrun_check(
    nproc: int, check_args: list[str], report_path: str, torchrun_args: list[str] | None = None, launch: str = "fork"
) -> int:
    """Launch, wait, and return the exit code of this run's report (see exit_code_after_run)."""
    cmd = torchrun_command(check_args, [f"--nproc-per-node={nproc}", *(torchrun_args or [])], launch)
    env = dict(os.environ)
    # torchrun sets OMP_NUM_THREADS=1 for nproc > 1 anyway, with a banner; say it quietly.
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    if sys.stdout.isatty() and sys.stderr.isatty():
        from distdiag.report.render import PROGRESS_ENV

        env[PROGRESS_ENV] = "stdout"  # the ranks' stderr is our pipe: rank 0 shows progress on stdout
    with Launch(report_path, nproc) as launch_:
        env.update(launch_.env())
        end, lines = run_filtered(cmd, env, launch_)
        return exit_code_after_run(launch_, end, lines)
