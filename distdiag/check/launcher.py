"""Run `torchrun ... -m distdiag.check` for the user and return the verdict's exact code.

torchrun exits 1 for any failed worker and prints its own traceback (docs/facts.md); this takes
the code from the report the check wrote and keeps torchrun's noise out of the user's way
(all of it is shown with DISTDIAG_DEBUG=1).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = [
    "run_torchrun_check",
    "launch_mode",
    "run_forwarding_signals",
    "exit_code_after_run",
    "filter_torchrun_stderr",
    "torchrun_command",
    "run_gate",
    "run_filtered",
    "STOP_WAIT_S",
]

_GLOG = re.compile(r"^([WEIF]\d{4} \d\d:\d\d:\d\d|\*+\s*$|Setting OMP_NUM_THREADS environment variable)")


LAUNCH_ENV = "DISTDIAG_LAUNCH"


def launch_mode(flag: str | None) -> str:
    """How the ranks start: the --launch flag, else DISTDIAG_LAUNCH, else fork (ConfigError
    for a value that is neither fork nor torchrun)."""
    from distdiag.check.options import LAUNCHES
    from distdiag.errors import ConfigError

    value = flag or os.environ.get(LAUNCH_ENV, "").strip() or "fork"
    if value not in LAUNCHES:
        source = "--launch" if flag else LAUNCH_ENV
        raise ConfigError(f"{source}: {value!r} is not one of {', '.join(LAUNCHES)}")
    return value


def torchrun_command(check_args: list[str], torchrun_args: list[str], launch: str = "fork") -> list[str]:
    """fork: torchrun's launcher in distdiag.check.forkrun (imports once, forks the ranks);
    torchrun: `torchrun ... -m distdiag.check`, every rank a fresh interpreter."""
    if launch == "fork":
        return [sys.executable, "-m", "distdiag.check.forkrun", *torchrun_args, "--", *check_args]
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args, "-m", "distdiag.check", *check_args]


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
    """Collect torchrun's stderr; live (DISTDIAG_DEBUG=1): also show every line as it comes,
    torchrun's log lines included, since that is what the errors tell users to rerun for."""
    for line in src:
        if live:
            sys.stderr.write(line)
            sys.stderr.flush()
        sink.append(line)


STOP_WAIT_S = 60.0
"""After forwarding SIGTERM, how long torchrun gets to stop its workers (it gives them 30 s
before its own SIGKILL) before the launcher kills what is left of the job."""


def _kill_tree(pid: int) -> None:
    """SIGKILL torchrun and every process under it. Its workers run in sessions of their own
    (docs/facts.md), so killing torchrun alone would orphan them: collect them first."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.Error:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


def run_forwarding_signals(
    cmd: list[str],
    env: dict[str, str],
    on_start: Callable[[subprocess.Popen[str]], None] | None = None,
    **popen: Any,
) -> tuple[int, str | None]:
    """Run torchrun, passing our SIGTERM/SIGINT on to it; (exit code, name of the signal we got).

    torchrun runs in a session of its own, so that it gets one signal, ours, not also the
    terminal's Ctrl-C. SIGINT goes on as SIGTERM: the check's sentinels turn SIGTERM into a
    'terminated' report, while SIGINT would only interrupt a rank's main thread once its
    collective returned. After a signal the wait is bounded (STOP_WAIT_S); a second signal
    kills the job at once.
    """
    got: list[int] = []
    started: list[subprocess.Popen[str]] = []

    def forward(signum: int, frame: Any) -> None:
        got.append(signum)
        if not started:
            return  # not launched yet: forwarded right after the launch
        if len(got) > 1:
            _kill_tree(started[0].pid)
            return
        try:
            started[0].send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, forward)
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, **popen)
        started.append(proc)
        if got:
            proc.send_signal(signal.SIGTERM)
        if on_start is not None:
            on_start(proc)
        forwarded_at: float | None = None
        while True:
            try:
                rc = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if got and forwarded_at is None:
                    forwarded_at = time.monotonic()
                if forwarded_at is not None and time.monotonic() - forwarded_at > STOP_WAIT_S:
                    sys.stderr.write(f"distdiag: torchrun did not stop within {STOP_WAIT_S:g}s of SIGTERM; killing the job\n")
                    _kill_tree(proc.pid)
                    rc = proc.wait(timeout=30)
                    break
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return rc, (signal.Signals(got[0]).name if got else None)


def run_torchrun_check(
    nproc: int, check_args: list[str], report_path: str, torchrun_args: list[str] | None = None, launch: str = "fork"
) -> int:
    """Launch, wait, and return the exit code recorded in the report (3 when none was written,
    or when torchrun failed although the report passed: a rank died after the verdict)."""
    debug = os.environ.get("DISTDIAG_DEBUG") == "1"
    cmd = torchrun_command(check_args, [f"--nproc-per-node={nproc}", *(torchrun_args or [])], launch)
    started = time.time()
    env = dict(os.environ)
    # torchrun sets OMP_NUM_THREADS=1 for nproc > 1 anyway, with a banner; say it quietly.
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    if sys.stdout.isatty() and sys.stderr.isatty():
        from distdiag.report.render import PROGRESS_ENV

        env[PROGRESS_ENV] = "stdout"  # the ranks' stderr is our pipe: rank 0 shows progress on stdout
    lines: list[str] = []
    pumps: list[threading.Thread] = []

    def pump_stderr(proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        thread = threading.Thread(target=_pump, args=(proc.stderr, lines, debug), name="distdiag-stderr", daemon=True)
        thread.start()
        pumps.append(thread)

    rc, stopped_by = run_forwarding_signals(cmd, env, pump_stderr, stderr=subprocess.PIPE, text=True, bufsize=1)
    for thread in pumps:
        thread.join(timeout=5)
    if not debug:
        for line in filter_torchrun_stderr(lines):
            sys.stderr.write(line)
    return exit_code_after_run(report_path, started, rc, stopped_by)


def exit_code_after_run(report_path: str, started: float, rc: int, stopped_by: str | None = None) -> int:
    """The check's exit code from the report it wrote (when written after `started`) and
    torchrun's exit code `rc` (2: bad input, said before any rank started); prints one line
    when they disagree or no report came."""
    from distdiag.errors import ReportError
    from distdiag.report.model import read_report

    path = Path(report_path)
    fresh = path.exists() and path.stat().st_mtime >= started - 1
    why = f"stopped by {stopped_by}; " if stopped_by else ""
    if fresh:
        try:
            code = read_report(path).exit_code
        except ReportError as exc:
            sys.stderr.write(f"distdiag: error: {exc}\n")
            return 3
        if code == 0 and rc != 0:
            # The verdict passed, then a rank died (or torchrun failed) before the job ended.
            sys.stderr.write(
                f"distdiag: error: {why}the report says pass but torchrun exited {rc}: a rank failed after the "
                "verdict; exiting 3 (rerun with DISTDIAG_DEBUG=1 for torchrun's log)\n"
            )
            return 3
        return code
    if rc == 0:
        return 0
    if rc == 2 and not stopped_by:
        # Bad input caught before any rank started (distdiag.check.forkrun, or torchrun's own
        # options): the one line saying what is wrong is on stderr already.
        return 2
    sys.stderr.write(
        f"distdiag: error: {why}torchrun exited {rc} and no report was written to {path}; "
        "a rank died before the check could report (rerun with DISTDIAG_DEBUG=1 for torchrun's log)\n"
    )
    return 3


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
  DISTDIAG_CHECK_ARGS  more arguments for the check (e.g. "--timeout-s 60"), split like a shell
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
        return check_args + shlex.split(os.environ.get("DISTDIAG_CHECK_ARGS", ""))
    except ValueError as exc:
        raise ConfigError(f"DISTDIAG_CHECK_ARGS: {exc}") from None


def run_filtered(cmd: list[str], env: dict[str, str]) -> tuple[int, str | None]:
    """run_forwarding_signals with torchrun's stderr through the filter `distdiag check` uses
    (its log lines, the OMP_NUM_THREADS banner and its ChildFailedError traceback dropped, the
    ranks' own lines kept, written when the job ended); DISTDIAG_DEBUG=1 shows all of it live."""
    debug = os.environ.get("DISTDIAG_DEBUG") == "1"
    lines: list[str] = []
    pumps: list[threading.Thread] = []

    def pump_stderr(proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        thread = threading.Thread(target=_pump, args=(proc.stderr, lines, debug), name="distdiag-stderr", daemon=True)
        thread.start()
        pumps.append(thread)

    result = run_forwarding_signals(cmd, env, pump_stderr, stderr=subprocess.PIPE, text=True, bufsize=1)
    for thread in pumps:
        thread.join(timeout=5)
    if not debug:
        sys.stderr.writelines(filter_torchrun_stderr(lines))
    return result


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


def run_gate(argv: list[str]) -> int:
    """`distdiag gate [torchrun options] -- COMMAND...`: the check, then exec COMMAND if it passed.

    Returns the exit code when the job must not start (or on a usage error); on a pass the
    process becomes the training command and never returns.
    """
    import shlex
    import socket

    from distdiag.errors import ConfigError

    if argv[:1] in (["-h"], ["--help"]):
        print(GATE_HELP)
        return 0
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        sys.stderr.write(f"distdiag: error: {GATE_USAGE}\n")
        return 2
    split = argv.index("--")
    torchrun_args, command = argv[:split], argv[split + 1 :]
    report = os.environ.get("DISTDIAG_REPORT") or "distdiag-gate-report.json"
    try:
        _check_gate_report_path(report)
        cmd = torchrun_command(_gate_check_args(report), torchrun_args, launch_mode(None))
    except ConfigError as exc:
        sys.stderr.write(f"distdiag: error: {exc}\n")
        return 2
    # A report left by an earlier run must not pass for this one (exit_code_after_run also
    # ignores a report older than this run, e.g. behind a symlink).
    if os.path.isfile(report) and not os.path.islink(report):
        os.unlink(report)
    started = time.time()
    rc, stopped_by = run_filtered(cmd, dict(os.environ))  # as quiet as `distdiag check`
    code = exit_code_after_run(report, started, rc, stopped_by)
    host = socket.gethostname()
    if code != 0 or stopped_by:
        code = code or 3
        sys.stderr.write(
            f"distdiag gate: the distdiag gate failed on {host} (exit {code}, torchrun exited {rc}); "
            f"report: {report}; not starting the job\n"
        )
        return code
    sys.stderr.write(f"distdiag gate: the distdiag gate passed on {host}; starting: {shlex.join(command)}\n")
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
