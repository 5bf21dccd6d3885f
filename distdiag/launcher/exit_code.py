"""The exit code of this run alone, from this run's report.

`distdiag check` and `distdiag gate` used to take any report written in the last second as
this run's, and torchrun's exit 0 without a report as a pass: a PASS left by the previous run
passed for a run that had bad input, and a job killed by a second Ctrl-C exited 0. Now the
launcher removes the report an earlier run left, gives its ranks an id to write into theirs
(launch.py, ranks.py), and `exit_code_after_run` decides from this run's report, the verdict
note, torchrun's code and the signals the launcher got: exit 0 only with this run's passing
report in hand; any other end is non-zero and says why in one line, and leaves a report
saying so when no rank could write one (naming the rank lost first and what it was doing,
when torchrun and the ranks' phase notes tell). `distdiag watch` reads this run's hang report
the same way (launcher/watch.py).
"""

from __future__ import annotations

import os
import re
import signal
from typing import TYPE_CHECKING, Any

from distdiag.errors import print_line
from distdiag.launcher.launch import Launch
from distdiag.launcher.ranks import read_json
from distdiag.report.model import EXIT_BAD_INPUT, EXIT_CANCELLED, EXIT_HANG, Report

if TYPE_CHECKING:
    from distdiag.launcher.child import JobEnd

__all__ = ["exit_code_after_run", "lost_rank_words", "first_failure_in", "signal_words", "orphans_words", "signal_name",
           "rank_note"]


def signal_words(name: str) -> str:
    return "SIGINT (Ctrl-C)" if name == "SIGINT" else name


def signal_name(exitcode: int) -> str | None:
    """'SIGABRT' for torchrun's exit code -6, 'signal 70' for a number no signal has; None for a
    process that exited by itself (exitcode >= 0)."""
    if exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def rank_note(launch: Launch, rank: int) -> dict[str, Any]:
    """The last note rank `rank` left in this launch's folder (note_phase: phase, pid), or {}."""
    return read_json(os.path.join(launch.folder, f"rank-{rank}.json")) or {}


def orphans_words(end: JobEnd) -> str:
    """What the launcher did when torchrun's agent was killed under a running job (`end`:
    child.JobEnd with orphans)."""
    return (f"torchrun's agent was killed by signal {-end.rc}; its {len(end.orphans)} rank(s) left running "
            f"(pids {', '.join(map(str, end.orphans))}) were ended")


_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank")
_ROOT_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)")
_ROOT_HOST = re.compile(r"^\s*host\s*:\s*(\S+)")


def first_failure_in(lines: list[str]) -> dict[str, Any] | None:
    """The root cause of torchrun's ChildFailedError summary on its stderr (--launch torchrun):
    {rank, pid, exitcode, host}, or None."""
    found: dict[str, Any] = {}
    after = False
    for line in lines:
        after = after or "Root Cause (first observed failure)" in line
        if not after:
            continue
        for key, pattern in (("host", _ROOT_HOST), ("rank", _ROOT_RANK), ("exit", _ROOT_EXIT)):
            match = pattern.match(line)
            if match and key not in found:
                found[key] = match.groups()
        if len(found) == 3:
            return {"rank": int(found["rank"][0]), "exitcode": int(found["exit"][0]), "pid": int(found["exit"][1]),
                    "host": found["host"][0]}
    return None


def _first_failure(launch: Launch, lines: list[str]) -> dict[str, Any] | None:
    return read_json(os.path.join(launch.folder, "first_failure.json")) or first_failure_in(lines)


def _add_the_signal(report: Report, launch: Launch, lines: list[str], where: str) -> None:
    """A survivor's report blames a rank lost before it could say how (SIGKILL leaves nothing a
    peer can read); torchrun saw it end first, killed by a signal: the report's notes say so too,
    and one line (the exit code is the report's)."""
    from distdiag.runtime.lastword import blamed_ranks

    failure = _first_failure(launch, lines)
    if not failure or int(failure["exitcode"]) >= 0 or int(failure["rank"]) not in blamed_ranks(report):
        return
    note = f"torchrun saw {lost_rank_words(launch, lines)}"
    launch.amend_report(report, report.exit_code, report.outcome, note)
    print_line(f"distdiag: {note} (the report says so too: {where})")


def lost_rank_words(launch: Launch, lines: list[str]) -> str | None:
    """'rank 1 (pid 42 on host h) ended first (killed by SIGKILL) while importing torch and the
    check': the rank torchrun saw fail first and what it noted it was doing; None if unknown."""
    failure = _first_failure(launch, lines)
    if not failure:
        return None
    code = int(failure["exitcode"])
    name = signal_name(code)
    how = f"killed by {name}" if name and not name.startswith("signal ") else f"exit {code}"
    noted = rank_note(launch, failure["rank"])
    doing = f" while {noted['phase']}" if noted.get("phase") else " while starting, before it imported the check"
    return f"rank {failure['rank']} (pid {failure['pid']} on host {failure['host']}) ended first ({how}){doing}"


def exit_code_after_run(launch: Launch, end: JobEnd, lines: list[str] | None = None) -> int:
    """The launcher's exit code: this run's report's, kept only when torchrun agrees (a pass
    with torchrun failing is 3: a rank failed after the verdict); the verdict note's when its
    report could not be written; 2 for bad input said before any rank started; else 3. Says
    in one line why, when the report alone does not (`end`: child.JobEnd)."""
    for line in [*end.notes, *([orphans_words(end)] if getattr(end, "orphans", None) else [])]:
        print_line(f"distdiag: {line}")
    report = launch.report()
    where = os.path.abspath(launch.report_path)
    if report is not None:
        code = _code_of_report(report, end, where, launch)
        if code == EXIT_HANG and report.outcome == "lost_rank" and end.rc != 0 and not end.killed_why:
            _add_the_signal(report, launch, lines or [], where)
        return code
    note = launch.note()
    if note is not None and not note.get("report_written"):
        code = int(note["exit_code"])
        if code != 0:
            print_line(f"distdiag: error: the verdict (exit {code}) could not be written to {where}; exiting {code}")
            return code
        print_line(f"distdiag: error: the check passed but its report could not be written to {where}; exiting {EXIT_HANG}")
        return EXIT_HANG
    if end.stopped_by:
        why = f"cancelled by {signal_words(end.stopped_by)} before any rank could report (still starting)"
        print_line(f"distdiag: {why}; exit {EXIT_CANCELLED}")
        launch.leave_report(EXIT_CANCELLED, "cancelled", f"the run was {why}")
        return EXIT_CANCELLED
    if end.rc == EXIT_BAD_INPUT and not end.killed_why:
        # Bad input caught before any rank started (distdiag.launcher.forkrun, or torchrun's own
        # options): the one line saying what is wrong is on stderr already.
        launch.leave_report(EXIT_BAD_INPUT, "bad_input", "bad input: nothing ran (see the error line on stderr)")
        return EXIT_BAD_INPUT
    lost = None if end.killed_why or end.rc == 0 else lost_rank_words(launch, lines or [])
    why = end.killed_why or (f"{lost}, before the check could report" if lost else _no_report_why(end.rc))
    print_line(f"distdiag: error: {why}; no rank could write the report (it says so now); exiting {EXIT_HANG} "
               "(rerun with DISTDIAG_DEBUG=1 for torchrun's log)")
    launch.leave_report(EXIT_HANG, "lost_rank", why)
    return EXIT_HANG


def _no_report_why(rc: int) -> str:
    if rc == 0:
        return "torchrun exited 0 but no rank reported a verdict (a rank left early, e.g. the target called exit)"
    if rc < 0:
        return f"torchrun was ended by signal {-rc}"
    return f"torchrun exited {rc}: a rank died before the check could report"


def _code_of_report(report: Report, end: JobEnd, where: str, launch: Launch) -> int:
    code = report.exit_code
    if end.stopped_by and report.outcome in ("cancelled", "terminated"):
        print_line(f"distdiag: cancelled by {signal_words(end.stopped_by)}: {report.summary}; report: {where} "
                   f"(exit {code})")
        return code
    if code == 0 and end.stopped_by and not end.killed_why:
        # The signal came too late to stop the probes: the run passed, but the user asked to
        # stop, and a script (the gate) must not go on as if nothing happened. torchrun may
        # exit 1 here (the forwarded signal ended ranks that were leaving): that is the
        # user's signal, not a rank failing - one that died or stopped by itself after the
        # verdict makes its report say so (exit 3, distdiag/check/finish.py).
        print_line(f"distdiag: cancelled by {signal_words(end.stopped_by)} as the run finished (its probes "
                   f"passed; the report says so and that it was cancelled: {where}); exit {EXIT_CANCELLED}")
        launch.amend_report(report, EXIT_CANCELLED, "cancelled",
                            f"cancelled by {signal_words(end.stopped_by)} as the run finished: the probes passed")
        return EXIT_CANCELLED
    if code == 0 and (end.rc != 0 or end.killed_why or end.stopped_by):
        # The verdict passed, then a rank died (or the job had to be ended) before it was over.
        why = f"stopped by {end.stopped_by}; " if end.stopped_by else f"{end.killed_why}; " if end.killed_why else ""
        print_line(
            f"distdiag: error: {why}the probes passed but torchrun exited {end.rc}: a rank failed after the "
            f"verdict; exiting {EXIT_HANG} (the report says so; rerun with DISTDIAG_DEBUG=1 for torchrun's log)"
        )
        launch.amend_report(report, EXIT_HANG, "lost_rank", f"{why}the probes passed, then a rank failed after the "
                            f"verdict (torchrun exited {end.rc})")
        return EXIT_HANG
    return code
