"""`distdiag gate [torchrun options] -- TRAINING COMMAND...`: the check on this node's ranks,
then the training command exec'd only if it passed; otherwise the check's own exit code."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from distdiag.errors import print_line
from distdiag.launcher.argv import launch_mode, split_dashes, torchrun_command, world_size
from distdiag.launcher.child import exec_command, run_filtered
from distdiag.launcher.exit_code import exit_code_after_run
from distdiag.launcher.launch import Launch

__all__ = ["run_gate", "GATE_HELP", "GATE_USAGE"]


GATE_USAGE = "usage: distdiag gate [torchrun options] -- TRAINING COMMAND..."

GATE_HELP = f"""{GATE_USAGE}

The cluster gate: run distdiag's check on this node's ranks (torchrun with the job's own
options, the `gate` profile), then exec the training command only if the check passed;
otherwise exit with the check's own code. Run it once per node (srun --ntasks-per-node=1,
a PyTorchJob pod, ...); torchrun also reads its options from PET_* variables (Kubeflow).
launch/gate.sh is this same command for scripts that call a file.

Exit codes: the training command's when the gate passed; else the check's verdict (1 a probe
failed, 2 bad input, 3 a rank hung or died, 4 take this node out), read from the report
each node's local rank 0 writes (torchrun itself turns every failure into 1).

Environment:
  DISTDIAG_PROFILE     profile of the check (default: gate)
  DISTDIAG_CONFIG      a TOML config layered over the profile (expected busbw, GPUs per node)
  DISTDIAG_REPORT      where this node's report goes (default: distdiag-gate-report.json)
  DISTDIAG_JUNIT       where this node's JUnit XML goes (default: none)
  DISTDIAG_CHECK_ARGS  more arguments for the check (e.g. "--timeout-s 60"), split like a shell;
                       not --report or --junit (DISTDIAG_REPORT and DISTDIAG_JUNIT say those)
  DISTDIAG_LAUNCH      fork (default): import torch once, fork the ranks (torchrun's --run-path
                       --start-method fork); torchrun: each rank its own python -m distdiag.check
  DISTDIAG_DEBUG=1     torchrun's own stderr as it comes (otherwise its log lines and the
                       OMP_NUM_THREADS banner are left out, as in distdiag check)

Example: distdiag gate --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
             --rdzv-endpoint head:29500 --rdzv-id job1 -- torchrun ... train.py"""


def _gate_check_args(report: str) -> list[str]:
    """The check's command line from the gate's DISTDIAG_* variables (ConfigError when
    DISTDIAG_CHECK_ARGS does not split like a shell)."""
    import shlex

    from distdiag.errors import ConfigError

    check_args = ["--profile", os.environ.get("DISTDIAG_PROFILE") or "gate", "--report", report, "--quiet"]
    if os.environ.get("DISTDIAG_CONFIG"):
        check_args += ["--config", os.environ["DISTDIAG_CONFIG"]]
    if os.environ.get("DISTDIAG_JUNIT"):
        check_args += ["--junit", os.environ["DISTDIAG_JUNIT"]]
    try:
        extra = shlex.split(os.environ.get("DISTDIAG_CHECK_ARGS", ""))
    except ValueError as exc:
        raise ConfigError(f"DISTDIAG_CHECK_ARGS: {exc}") from None
    for flag, variable in (("--report", "DISTDIAG_REPORT"), ("--junit", "DISTDIAG_JUNIT")):
        # the gate reads and checks the file it names itself; one given here would be written
        # by the ranks unchecked, over whatever file it names
        if any(arg == flag or arg.startswith(f"{flag}=") for arg in extra):
            raise ConfigError(f"DISTDIAG_CHECK_ARGS: {flag} is the gate's own; set {variable} instead")
    return check_args + extra


def _check_gate_report_path(report: str) -> None:
    """The gate's report path is refused here, in one line, when it is a link, FIFO or directory
    (distdiag/report/safefile.py): the ranks would refuse it too, and the gate would then
    read whatever the link points at as the verdict."""
    from distdiag.errors import ConfigError
    from distdiag.report.safefile import RefusedFile, check_output_path

    try:
        check_output_path(report, "set DISTDIAG_REPORT to a file path")
    except RefusedFile as exc:
        raise ConfigError(f"DISTDIAG_REPORT: {exc}") from None


def _gate_bad_input(message: str, report: str, *, leave_report: bool = True) -> int:
    """One line, exit 2, and a report saying nothing ran in place of an earlier run's (for a
    mistyped gate command line, just no earlier run's report)."""
    from distdiag.launcher.launch import remove_stale_report
    from distdiag.launcher.ranks import write_bad_input_report

    print_line(f"distdiag: error: {message}")
    remove_stale_report(report)
    if leave_report:
        write_bad_input_report(message, report, 1)
    return 2


def run_gate(argv: list[str], on_stop: Callable[[str | None], None] | None = None) -> int:
    """`distdiag gate [torchrun options] -- COMMAND...`: the check, then exec COMMAND if it passed.

    Returns the exit code when the job must not start (or on a usage error), after calling
    `on_stop` with the path of this run's report (None: there is none of this run's); on a pass
    the process becomes the training command and never returns.
    """
    import shlex
    import socket

    from distdiag.errors import ConfigError

    if argv[:1] in (["-h"], ["--help"]):
        print(GATE_HELP)
        return 0
    report = os.environ.get("DISTDIAG_REPORT") or "distdiag-gate-report.json"
    try:
        torchrun_args, command = split_dashes(argv, GATE_USAGE, command=True)
    except ValueError:
        return _gate_bad_input(GATE_USAGE, report, leave_report=False)
    try:
        _check_gate_report_path(report)
        cmd = torchrun_command(_gate_check_args(report), torchrun_args, launch_mode(None))
    except ConfigError as exc:
        return _gate_bad_input(str(exc), report)
    with Launch(report, lambda: world_size(torchrun_args) or 1) as launch:
        env = dict(os.environ, **launch.env())
        end, lines = run_filtered(cmd, env, launch)  # as quiet as `distdiag check`
        code = exit_code_after_run(launch, end, lines)
        ours = report if on_stop is not None and launch.report() is not None else None
    rc, stopped_by = end.rc, end.stopped_by
    host = socket.gethostname()
    if code != 0 or stopped_by:
        code = code or 3
        sys.stderr.write(
            f"distdiag gate: the distdiag gate failed on {host} (exit {code}, torchrun exited {rc}); "
            f"report: {report}; not starting the job\n"
        )
        if on_stop is not None:
            on_stop(ours)
        return code
    sys.stderr.write(f"distdiag gate: the distdiag gate passed on {host}; starting: {shlex.join(command)}\n")
    return exec_command(command)
