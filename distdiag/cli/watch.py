"""`distdiag watch [torchrun options] [watch options] -- train.py ARGS...`: the zero-code
watchdog, launched for the user.

`torchrun -m distdiag.watch -- train.py` works as before, but torchrun exits 1 for any failed
worker and ends a hang report with its own `ChildFailedError` traceback (docs/facts.md). This runs
the same torchrun command, shows the ranks' output as it comes, keeps torchrun's log lines and
its traceback out of the way (all of it with DISTDIAG_DEBUG=1), so the hang report is the
last thing on the terminal, and exits with the verdict's code: the report's (3) when the
watchdog ended the job, else the script's own (read from torchrun's failure summary).
Arguments are taken as typed, from sys.argv (click would drop the `--`), as `distdiag gate`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from typing import IO, Any, NoReturn

import typer

from distdiag.cli.options import raw_args, register_passthrough
from distdiag.report.model import EXIT_CANCELLED, EXIT_HANG

__all__ = ["register", "run_watch", "WatchOutput"]

USAGE = "usage: distdiag watch [torchrun options] [watch options] -- train.py ARGS... (or -- -m module ARGS...)"

HELP = f"""{USAGE}

Runs `torchrun [torchrun options] -m distdiag.watch [watch options] -- train.py ARGS...`:
the training script unchanged, with distdiag's hang watchdog armed at init_process_group.
Watch options (python -m distdiag.watch -h): --timeout-s S, --action abort|raise|report,
--dump-dir DIR, --flight-recorder N, --nccl-timing, --wrap, --no-wrap; --junit PATH (this
command's: the verdict as JUnit XML, as `distdiag check --junit`); every other option before
`--` is torchrun's (--nproc-per-node, --standalone, --nnodes, --rdzv-*, ...).

Output: the ranks' stdout and stderr as they come, without torchrun's log lines and its
closing traceback (DISTDIAG_DEBUG=1 shows everything). Exit codes: 0 the script finished,
3 the watchdog found a hang or a lost rank (the report is the last thing printed), 2 bad
input, else the script's own exit code.

Example: distdiag watch --nproc-per-node 8 --timeout-s 300 -- train.py --lr 3e-4"""

_WATCH_VALUED = ("--timeout-s", "--action", "--dump-dir", "--flight-recorder")
_WATCH_FLAGS = ("--wrap", "--no-wrap", "--nccl-timing")
_TORCHRUN_FRAME = re.compile(r'^\s*File ".*torch/distributed/(run|launch|elastic/|launcher/)')
_ENDING = re.compile(r"^distdiag\[rank \d+\]: watchdog ending the process")
_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")


def _take_junit(argv: list[str]) -> tuple[str | None, list[str]]:
    """(--junit's PATH or None, the arguments without it): an option of this command, not of
    torchrun or distdiag.watch; only before `--` (after it, the script's arguments). Raises
    ValueError when PATH is missing."""
    end = argv.index("--") if "--" in argv else len(argv)
    path, rest, i = None, [], 0
    while i < end:
        word = argv[i]
        if word == "--junit":
            if i + 1 >= end:
                raise ValueError("--junit needs a PATH")
            path, i = argv[i + 1], i + 2
        elif word.startswith("--junit="):
            path, i = word.split("=", 1)[1], i + 1
        else:
            rest.append(word)
            i += 1
    if path is not None:
        from distdiag.report.safefile import RefusedFile, check_output_path

        try:
            check_output_path(path, "pass --junit a file path")
        except RefusedFile as exc:
            raise ValueError(f"--junit: {exc}") from None
    return path, rest + argv[end:]


def _junit_report(report_path: str, before: int | None, code: int, rc: int, cancelled: str | None = None) -> Any:
    """What --junit writes: this run's hang report when the watchdog ended the job, else a
    one-case report saying how the script ended (by itself, or `cancelled`: how it was)."""
    from distdiag.errors import ReportError
    from distdiag.report.model import Finding, ProbeResult, Report, read_report, verdict_for

    stamp = _stamp(report_path)
    if cancelled is None and rc != 0 and stamp is not None and stamp != before:
        try:
            return read_report(report_path)
        except ReportError:
            pass
    findings = [] if code == 0 else [Finding("error", f"{cancelled}; no hang report")] if cancelled else [Finding(
        "error", f"the script exited {code} without a hang report (it failed by itself, or the watchdog's report "
        f"could not be read at {report_path})")]
    probe = ProbeResult.from_findings("watchdog", findings)
    return Report(world_size=0, probes=[probe], exit_code=code, verdict=verdict_for(code, [probe]),
                  outcome="completed" if code == 0 else ("cancelled" if code == EXIT_CANCELLED else "terminated")
                  if cancelled else "raised",
                  summary="the script finished; no hang" if code == 0 else findings[0].issue)


def _split(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(torchrun's options, the watch options, the command after `--`)."""
    split = argv.index("--")
    ours, command = argv[:split], argv[split + 1 :]
    torchrun: list[str] = []
    watch: list[str] = []
    i = 0
    while i < len(ours):
        word = ours[i]
        name = word.split("=", 1)[0]
        if name in _WATCH_VALUED:
            take = 1 if "=" in word else 2
            watch += ours[i : i + take]
            i += take
        elif word in _WATCH_FLAGS:
            watch.append(word)
            i += 1
        else:
            torchrun.append(word)
            i += 1
    if command[:1] == ["-m"] and len(command) > 1:
        watch += ["-m", command[1]]
        command = command[2:]
    return torchrun, watch, command


class WatchOutput:
    """The ranks' stderr, line by line, as the user should see it: torchrun's log lines, the
    ranks' 'watchdog ending the process' lines and torchrun's own closing traceback are held
    back (`dropped`); a worker's traceback goes through once its first frame shows it is not
    torchrun's. `debug` passes everything."""

    def __init__(self, out: IO[str], debug: bool = False) -> None:
        self.out = out
        self.debug = debug
        self.held: list[str] = []
        self.holding = ""
        """'' passing lines, 'undecided' inside a traceback not yet placed, 'torchrun' in its."""
        self.dropped: list[str] = []

    def line(self, line: str) -> None:
        from distdiag.check.launcher import _GLOG

        if self.debug:
            self._write(line)
        elif self.holding == "torchrun":
            self.dropped.append(line)
        elif self.holding == "undecided":
            self.held.append(line)
            if line.lstrip().startswith("File ") and "<frozen runpy>" not in line:
                if _TORCHRUN_FRAME.match(line):
                    self.holding, self.dropped = "torchrun", self.dropped + self.held
                else:
                    self._release()
        elif line.startswith("Traceback (most recent call last):"):
            self.holding, self.held = "undecided", [line]
        elif _GLOG.match(line) or _ENDING.match(line):
            self.dropped.append(line)
        else:
            self._write(line)

    def close(self) -> None:
        if self.holding == "undecided":
            self._release()

    def worker_exit_code(self) -> int | None:
        """The root-cause worker's exit code, from torchrun's failure summary (its other
        failures, listed first, are mostly ranks torchrun itself ended with SIGTERM)."""
        root = next((i for i, line in enumerate(self.dropped) if "Root Cause" in line), 0)
        for line in self.dropped[root:]:
            m = _EXITCODE.search(line)
            if m:
                code = int(m.group(1))
                return 128 - code if code < 0 else code
        return None

    def _release(self) -> None:
        for held in self.held:
            self._write(held)
        self.held, self.holding = [], ""

    def _write(self, line: str) -> None:
        self.out.write(line)
        self.out.flush()


def _pump(src: IO[str], output: WatchOutput) -> None:
    for line in src:
        output.line(line)
    output.close()


def _stamp(path: str) -> int | None:
    """The file's modification time (ns), None when there is none."""
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _exit_code(report_path: str, before: int | None, rc: int, output: WatchOutput) -> int:
    """The report's code when the watchdog ended the job (a report written by this run: its
    stamp differs from `before`, taken at launch), else 0 when torchrun succeeded, else the
    failed worker's own code."""
    from distdiag.errors import ReportError
    from distdiag.report.model import read_report

    if rc == 0:
        return 0
    stamp = _stamp(report_path)
    if stamp is not None and stamp != before:
        try:
            return read_report(report_path).exit_code
        except ReportError as exc:
            sys.stderr.write(f"distdiag: error: {exc}\n")
            return EXIT_HANG
    code = output.worker_exit_code() or rc
    _say_who_failed(output, code)
    return code


def _say_who_failed(output: WatchOutput, code: int) -> None:
    """The script failed by itself (no hang report): one line naming the rank torchrun saw fail
    first, from the failure summary held back (the script's own output is shown already)."""
    from distdiag.check.launch_end import first_failure_in
    from distdiag.errors import print_line

    failure = first_failure_in(output.dropped)
    if failure is None:
        print_line(f"distdiag watch: the job failed (torchrun exited non-zero) without a hang report; exiting {code}")
        return
    status = failure["exitcode"]
    how = f"was killed by signal {-status}" if status < 0 else f"exited {status}"
    print_line(f"distdiag watch: rank {failure['rank']} (pid {failure['pid']} on host {failure['host']}) {how} "
               f"by itself (no hang report); exiting {code}")


def torchrun_problem(torchrun: list[str]) -> str | None:
    """What torchrun would reject among its options (with "did you mean" for a watch option
    mistyped, `--timeout` for `--timeout-s`), checked with torchrun's own parser before it
    starts: one line, not its 18-line usage after a torch import. None when they parse."""
    from torch.distributed.run import get_args_parser

    from distdiag.check.options import MAX_NPROC_PER_NODE
    from distdiag.errors import did_you_mean, unknown_option_hint

    parser = get_args_parser()

    def refuse(message: str) -> NoReturn:
        raise ValueError(message)

    parser.error = refuse  # type: ignore[method-assign]
    try:
        ns = parser.parse_args([*torchrun, "-m", "distdiag.watch"])
    except ValueError as exc:
        message = unknown_option_hint(parser, str(exc))
        if message.startswith("unrecognized arguments: ") and "did you mean" not in message:
            typo = message.split(": ", 1)[1]
            message += did_you_mean(typo, [*_WATCH_VALUED, *_WATCH_FLAGS])
        return f"{message} (torchrun's options: torchrun -h; watch options: distdiag watch -h)"
    except SystemExit:  # a -h among torchrun's options: torchrun printed its help
        return ""
    nproc = str(getattr(ns, "nproc_per_node", "1"))
    if nproc.isdigit() and not 1 <= int(nproc) <= MAX_NPROC_PER_NODE:
        return f"--nproc-per-node must be from 1 to {MAX_NPROC_PER_NODE} ranks (or auto, cpu, gpu), got {nproc[:40]}"
    return None


class _WatchedJob:
    """What the launcher keeps of a watched training job: the job watch (distdiag/check/jobwatch.py)
    without the check's verdict (a training job runs for days after a report under
    `--action report`: nothing here ends it for lingering), with a rank stopped before its
    watchdog armed ended after the timeout and 10 s more."""

    def __init__(self, timeout_s: float) -> None:
        from distdiag.check.jobwatch import JobWatch

        self.watch = JobWatch(verdict_reached=lambda: False, rank_stopped_s=timeout_s + 10.0)

    def mark_cancelled(self, signal_name: str) -> None:
        return None  # the ranks learn it from torchrun's SIGTERM; the launcher says it in one line


def _ending(end: Any, report: str, before: int | None, output: WatchOutput, launch: _WatchedJob) -> tuple[int, str | None]:
    """(the exit code, how the job was cancelled or ended from outside, or None) once torchrun is back."""
    from distdiag.errors import print_line

    orphans = launch.watch.end_orphans() if end.rc < 0 else []
    if orphans:
        print_line(f"distdiag watch: torchrun's agent was killed by signal {-end.rc}; its {len(orphans)} rank(s) "
                   f"left running (pids {', '.join(map(str, orphans))}) were ended; exiting {EXIT_HANG}")
        return EXIT_HANG, f"torchrun's agent was killed by signal {-end.rc}"
    if end.killed_why:
        return EXIT_HANG, end.killed_why  # said in one line already ("...; killing the job")
    stamp = _stamp(report)
    if end.stopped_by and (stamp is None or stamp == before):
        # the user's Ctrl-C or a SIGTERM to distdiag watch (a cancelled job): every rank was
        # told to stop, so the watchdog wrote no report; not a failure of the job
        from distdiag.check.launch_end import signal_words

        print_line(f"distdiag watch: cancelled by {signal_words(end.stopped_by)}; the job was stopped "
                   f"(torchrun exited {end.rc}), no hang report; exiting {EXIT_CANCELLED}")
        return EXIT_CANCELLED, f"the job was cancelled by {signal_words(end.stopped_by)}"
    return _exit_code(report, before, end.rc, output), None


def run_watch(argv: list[str]) -> int:
    """Launch torchrun with the watchdog wrapper; the verdict's exit code."""
    from distdiag.check.launcher import run_forwarding_signals
    from distdiag.watch import _BadUsage, _parse
    from distdiag.watchdog.writer import REPORT_NAME

    if argv[:1] in (["-h"], ["--help"]):
        print(HELP)
        return 0
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        sys.stderr.write(f"distdiag: error: {USAGE}\n")
        return 2
    try:
        junit, argv = _take_junit(argv)
    except ValueError as exc:  # no PATH, or a link, FIFO or directory there
        sys.stderr.write(f"distdiag: error: {exc}\n")
        return 2
    torchrun, watch, command = _split(argv)
    try:
        _ns, config, _entries = _parse([*watch, "--", *command])
    except _BadUsage as exc:
        sys.stderr.write(f"distdiag: error: {exc}\n")
        return 2
    problem = torchrun_problem(torchrun)
    if problem is not None:
        if problem:
            sys.stderr.write(f"distdiag: error: {problem}\n")
        return 2 if problem else 0
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun, "-m", "distdiag.watch", *watch, "--", *command]
    output = WatchOutput(sys.stderr, debug=os.environ.get("DISTDIAG_DEBUG") == "1")
    pumps: list[threading.Thread] = []

    def pump_stderr(proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        thread = threading.Thread(target=_pump, args=(proc.stderr, output), name="distdiag-stderr", daemon=True)
        thread.start()
        pumps.append(thread)

    report = os.path.join(config.dump_dir, REPORT_NAME)
    before = _stamp(report)  # a report left by an earlier run is not this run's verdict
    launch = _WatchedJob(config.timeout_s)
    end = run_forwarding_signals(cmd, dict(os.environ), pump_stderr, launch, stderr=subprocess.PIPE, text=True,
                                 bufsize=1)
    for thread in pumps:
        thread.join(timeout=5)
    code, why = _ending(end, report, before, output, launch)
    if junit is not None:
        from distdiag.cli.options import write_junit_for

        write_junit_for(_junit_report(report, before, code, end.rc, why), junit, "watch")
    return code


def watch(ctx: typer.Context) -> None:
    """Run a training script under torchrun with the hang watchdog armed (see: distdiag watch -h)."""
    raise typer.Exit(run_watch(raw_args(ctx, "watch")))


def register(app: typer.Typer) -> None:
    register_passthrough(app, "watch", watch)
