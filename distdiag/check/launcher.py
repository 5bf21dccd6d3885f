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
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from distdiag.check.jobwatch import JobWatch, die_with_parent, kill_tree
from distdiag.check.launch_end import Launch, exit_code_after_run
from distdiag.errors import print_line

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
    "JobEnd",
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
    torchrun's log lines included, since that is what the errors tell users to rerun for.
    Rank 0's progress lines in plain logs (report/render.py PlainBeat) are shown as they come
    and not kept: they are signs of life, worth nothing once the job ended."""
    from distdiag.report.render import is_beat_line

    for line in src:
        beat = is_beat_line(line)
        if live or beat:
            sys.stderr.write(line)
            sys.stderr.flush()
        if not beat:
            sink.append(line)


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


class Launched(Protocol):
    """What run_forwarding_signals reads of a launch: a Launch, or `distdiag watch`'s job."""

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

    def forward(signum: int, frame: Any) -> None:
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
    return JobEnd(rc, name, killed_why, list(watch.ended) if watch is not None else [])


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


def run_filtered(cmd: list[str], env: dict[str, str], launch: Launch) -> tuple[JobEnd, list[str]]:
    """run_forwarding_signals with torchrun's stderr collected and, once the job ended, written
    through filter_torchrun_stderr (its log lines, the OMP_NUM_THREADS banner and its
    ChildFailedError traceback dropped, the ranks' own lines kept): `distdiag check` and
    `distdiag gate` alike. DISTDIAG_DEBUG=1 shows all of it live. A cancelled run is said in
    one line (launch_end.exit_code_after_run); the ranks' and torchrun's lines about the signal
    are noise then. Returns how the job ended and every stderr line."""
    debug = os.environ.get("DISTDIAG_DEBUG") == "1"
    lines: list[str] = []
    pumps: list[threading.Thread] = []

    def pump_stderr(proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        thread = threading.Thread(target=_pump, args=(proc.stderr, lines, debug), name="distdiag-stderr", daemon=True)
        thread.start()
        pumps.append(thread)

    end = run_forwarding_signals(cmd, env, pump_stderr, launch, stderr=subprocess.PIPE, text=True, bufsize=1)
    for thread in pumps:
        thread.join(timeout=5)
    if not debug and not end.stopped_by:
        sys.stderr.writelines(filter_torchrun_stderr(lines))
    return end, lines


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


def _gate_world(torchrun_args: list[str]) -> int:
    """This node's ranks, for a report the gate itself must leave (1 when not given as a number)."""
    value = ""
    for i, arg in enumerate(torchrun_args):
        name, _, attached = arg.partition("=")
        if name.replace("_", "-") == "--nproc-per-node":
            value = attached or (torchrun_args[i + 1] if i + 1 < len(torchrun_args) else "")
    return int(value) if value.isdigit() else 1


def _gate_bad_input(message: str, report: str, *, leave_report: bool = True) -> int:
    """One line, exit 2, and a report saying nothing ran in place of an earlier run's (for a
    mistyped gate command line, just no earlier run's report)."""
    from distdiag.check.launch_end import remove_stale_report
    from distdiag.check.launched import write_bad_input_report

    print_line(f"distdiag: error: {message}")
    remove_stale_report(report)
    if leave_report:
        write_bad_input_report(message, report, 1)
    return 2


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
    report = os.environ.get("DISTDIAG_REPORT") or "distdiag-gate-report.json"
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        return _gate_bad_input(GATE_USAGE, report, leave_report=False)
    split = argv.index("--")
    torchrun_args, command = argv[:split], argv[split + 1 :]
    try:
        _check_gate_report_path(report)
        cmd = torchrun_command(_gate_check_args(report), torchrun_args, launch_mode(None))
    except ConfigError as exc:
        return _gate_bad_input(str(exc), report)
    with Launch(report, _gate_world(torchrun_args)) as launch:
        env = dict(os.environ, **launch.env())
        end, lines = run_filtered(cmd, env, launch)  # as quiet as `distdiag check`
        code = exit_code_after_run(launch, end, lines)
    rc, stopped_by = end.rc, end.stopped_by
    host = socket.gethostname()
    if code != 0 or stopped_by:
        code = code or 3
        sys.stderr.write(
            f"distdiag gate: the distdiag gate failed on {host} (exit {code}, torchrun exited {rc}); "
            f"report: {report}; not starting the job\n"
        )
        return code
    sys.stderr.write(f"distdiag gate: the distdiag gate passed on {host}; starting: {shlex.join(command)}\n")
    return exec_command(command)


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
