"""`distdiag watch [torchrun options] [watch options] -- train.py ARGS...`: the zero-code
watchdog, launched for the user.

`torchrun -m distdiag.watch -- train.py` works as before, but torchrun exits 1 for any failed
worker and ends a hang report with its own `ChildFailedError` traceback (docs/facts.md). This runs
the same torchrun command as the check's launcher runs its own (child.py: signals forwarded, the
job watched from outside by jobwatch.py's rules for a training job, which may run for days),
shows the ranks' output as it comes, keeps torchrun's log lines and its traceback out of the
way (stderr.py; all of it with DISTDIAG_DEBUG=1), so the hang report is the last thing on the
terminal, and exits with the verdict's code: this run's hang report's (3) when the watchdog
ended the job - found by the launch id it carries, never by its file time - else the script's
own (read from torchrun's failure summary). Arguments are taken as typed (click would drop the
`--`), as `distdiag gate`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from distdiag.launcher.argv import split_dashes, take_option
from distdiag.launcher.child import JobEnd, run_forwarding_signals
from distdiag.launcher.jobwatch import training_rules
from distdiag.launcher.launch import Launch
from distdiag.launcher.ranks import RETURNED_PHASE
from distdiag.launcher.stderr import WatchOutput, pump
from distdiag.report.model import EXIT_CANCELLED, EXIT_HANG, Report

__all__ = ["run_watch", "HELP", "USAGE", "torchrun_problem"]

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


def _take_junit(argv: list[str]) -> tuple[str | None, list[str]]:
    """(--junit's PATH or None, the arguments without it): an option of this command, not of
    torchrun or distdiag.watch; only before `--` (after it, the script's arguments). Raises
    ValueError when PATH is missing, or names a link, FIFO or directory."""
    path, rest = take_option(argv, "--junit", "--junit needs a PATH")
    if path is not None:
        from distdiag.report.safefile import RefusedFile, check_output_path

        try:
            check_output_path(path, "pass --junit a file path")
        except RefusedFile as exc:
            raise ValueError(f"--junit: {exc}") from None
    return path, rest


def _junit_report(report_path: str, ours: Report | None, code: int, rc: int, cancelled: str | None = None) -> Report:
    """What --junit writes: this run's hang report (`ours`) when the watchdog ended the job,
    else a one-case report saying how the script ended (by itself, or `cancelled`: how it was)."""
    from distdiag.report.model import Finding, ProbeResult, verdict_for

    if cancelled is None and rc != 0 and ours is not None:
        return ours
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
    ours, command = split_dashes(argv, USAGE, command=True)
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


def _exit_code(ours: Report | None, rc: int, output: WatchOutput, launch: Launch | None = None) -> int:
    """This run's hang report's code when the watchdog ended the job, else 0 when torchrun
    succeeded, else the failed worker's own code."""
    if rc == 0:
        return 0
    if ours is not None:
        return ours.exit_code
    code = output.worker_exit_code() or rc
    _say_who_failed(output, code, launch)
    return code


def _say_who_failed(output: WatchOutput, code: int, launch: Launch | None = None) -> None:
    """The script failed by itself (no hang report): one line naming the rank torchrun saw fail
    first, from the failure summary held back (the script's own output is shown already), and
    when it died: in the training, or in the interpreter's exit after its script returned."""
    from distdiag.errors import print_line
    from distdiag.launcher.exit_code import first_failure_in, rank_note, signal_name

    failure = first_failure_in(output.dropped)
    if failure is None:
        print_line(f"distdiag watch: the job failed (torchrun exited non-zero) without a hang report; exiting {code}")
        return
    status = failure["exitcode"]
    name = signal_name(status)
    how = f"was killed by {name}" if name else f"exited {status}"
    who = f"rank {failure['rank']} (pid {failure['pid']} on host {failure['host']})"
    noted = rank_note(launch, failure["rank"]) if launch is not None else {}
    if noted.get("phase") == RETURNED_PHASE and noted.get("pid") == failure["pid"]:
        known = (" (torch's gloo worker aborts a process when it frees a finished collective while Python shuts "
                 "down: see 'A script can abort at exit' in docs/facts.md)") if status == -signal.SIGABRT else ""
        print_line(f"distdiag watch: {who} {how} after its script returned, in the interpreter's exit: the "
                   f"training itself ended normally{known}; exiting {code}")
        return
    print_line(f"distdiag watch: {who} {how} by itself (no hang report); exiting {code}")


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


def _ending(end: JobEnd, launch: Launch, output: WatchOutput) -> tuple[int, str | None, Report | None]:
    """(the exit code, how the job was cancelled or ended from outside, or None, this run's hang
    report or None) once torchrun is back."""
    from distdiag.errors import print_line
    from distdiag.launcher.exit_code import orphans_words, signal_words

    ours = launch.report()
    if end.orphans:
        print_line(f"distdiag watch: {orphans_words(end)}; exiting {EXIT_HANG}")
        return EXIT_HANG, f"torchrun's agent was killed by signal {-end.rc}", ours
    if end.killed_why:
        return EXIT_HANG, end.killed_why, ours  # said in one line already ("...; killing the job")
    if end.stopped_by and ours is None:
        # the user's Ctrl-C or a SIGTERM to distdiag watch (a cancelled job): every rank was
        # told to stop, so the watchdog wrote no report; not a failure of the job
        print_line(f"distdiag watch: cancelled by {signal_words(end.stopped_by)}; the job was stopped "
                   f"(torchrun exited {end.rc}), no hang report; exiting {EXIT_CANCELLED}")
        return EXIT_CANCELLED, f"the job was cancelled by {signal_words(end.stopped_by)}", ours
    return _exit_code(ours, end.rc, output, launch), None, ours


def _command(argv: list[str]) -> tuple[list[str], list[str], Any, str | None] | int:
    """(torchrun's options, the torchrun command, the watchdog's config, --junit's path), or the
    exit code when there is nothing to run (help, bad input: said in one line)."""
    from distdiag.watch import _BadUsage, _parse

    if argv[:1] in (["-h"], ["--help"]):
        print(HELP)
        return 0
    try:
        split_dashes(argv, USAGE, command=True)
        junit, argv = _take_junit(argv)
        torchrun, watch, command = _split(argv)
        _ns, config, _entries = _parse([*watch, "--", *command])
    except (ValueError, _BadUsage) as exc:  # no `--`, no --junit PATH (or a link there), a bad watch option
        sys.stderr.write(f"distdiag: error: {exc}\n")
        return 2
    problem = torchrun_problem(torchrun)
    if problem is not None:
        if problem:
            sys.stderr.write(f"distdiag: error: {problem}\n")
        return 2 if problem else 0
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun, "-m", "distdiag.watch", *watch, "--", *command]
    return torchrun, cmd, config, junit


def run_watch(argv: list[str], write_junit: Callable[[Report, str], None] | None = None) -> int:
    """Launch torchrun with the watchdog wrapper; the verdict's exit code. `write_junit(report,
    path)` writes --junit's file."""
    from distdiag.launcher.argv import world_size
    from distdiag.watchdog.writer import REPORT_NAME

    planned = _command(argv)
    if isinstance(planned, int):
        return planned
    torchrun, cmd, config, junit = planned
    output = WatchOutput(sys.stderr, debug=os.environ.get("DISTDIAG_DEBUG") == "1")
    pumps: list[threading.Thread] = []

    def pump_stderr(proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        thread = threading.Thread(target=pump, args=(proc.stderr, output), name="distdiag-stderr", daemon=True)
        thread.start()
        pumps.append(thread)

    report = os.path.join(config.dump_dir, REPORT_NAME)
    with Launch(report, lambda: world_size(torchrun) or 1, rules=training_rules(config.timeout_s),
                remove_stale=False) as launch:
        end = run_forwarding_signals(cmd, dict(os.environ, **launch.env()), pump_stderr, launch,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)
        for thread in pumps:
            thread.join(timeout=5)
        code, why, ours = _ending(end, launch, output)
        if ours is not None:
            output.verdict_again()
    if junit is not None and write_junit is not None:
        write_junit(_junit_report(report, ours, code, end.rc, why), junit)
    return code
