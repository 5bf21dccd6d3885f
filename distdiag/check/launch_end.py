"""The launcher's side of one launch: its id, its folder, and the exit code of this run alone.

`distdiag check` and `distdiag gate` used to take any report written in the last second as
this run's, and torchrun's exit 0 without a report as a pass: a PASS left by the previous run
passed for a run that had bad input, and a job killed by a second Ctrl-C exited 0 (issue 24).
Now the launcher removes the report an earlier run left, gives its ranks an id to write into
theirs (distdiag.check.launched), and `exit_code_after_run` decides from this run's report,
the verdict note, torchrun's code and the signals the launcher got: exit 0 only with this
run's passing report in hand; any other end is non-zero and says why in one line, and leaves
a report saying so when no rank could write one (naming the rank lost first and what it was
doing, when torchrun and the ranks' phase notes tell).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import uuid
from pathlib import Path
from typing import Any

from distdiag.check.jobwatch import JobWatch
from distdiag.check.launched import LAUNCH_FOLDER_PREFIX, LAUNCH_ID_ENV, VERDICT_NOTE_ENV, read_verdict_note
from distdiag.errors import ReportError, print_line
from distdiag.report.model import EXIT_BAD_INPUT, EXIT_CANCELLED, EXIT_HANG, Report, read_report, write_report

__all__ = ["Launch", "exit_code_after_run", "remove_stale_report", "lost_rank_words", "first_failure_in", "signal_words"]


def remove_stale_report(path: str) -> None:
    """Remove the report an earlier run left at `path` (a regular file only: what stands
    behind a link is the link owner's; the launch id still keeps it from passing for ours)."""
    if os.path.isfile(path) and not os.path.islink(path):
        try:
            os.unlink(path)
        except OSError:
            pass


class Launch:
    """One launch: an id for the ranks' reports, a private folder for the verdict note and the
    cancel marker, the JobWatch of the job. A context manager (the folder goes at exit)."""

    def __init__(self, report_path: str, world_size: int) -> None:
        self.report_path = report_path
        self.world_size = world_size
        self.id = uuid.uuid4().hex
        self.folder = tempfile.mkdtemp(prefix=LAUNCH_FOLDER_PREFIX)
        self.note_path = os.path.join(self.folder, "verdict.json")
        self.watch = JobWatch(lambda: os.path.exists(self.note_path), self.noted_pids)
        remove_stale_report(report_path)

    def __enter__(self) -> Launch:
        return self

    def __exit__(self, *exc: Any) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def env(self) -> dict[str, str]:
        """What the ranks must know, through torchrun's environment."""
        return {LAUNCH_ID_ENV: self.id, VERDICT_NOTE_ENV: self.note_path}

    def mark_cancelled(self, signal_name: str) -> None:
        """The user (or the scheduler) stopped us: the ranks then leave the report unprinted
        (distdiag.check.launched.cancelled_by), as the launcher says it in one line."""
        try:
            Path(f"{self.note_path}.cancel").write_text(signal_name, encoding="utf-8")
        except OSError:
            pass

    def report(self) -> Report | None:
        """This run's report, or None (none, or one another run wrote: its id is not ours)."""
        if not os.path.exists(self.report_path):
            return None
        try:
            report = read_report(self.report_path)
        except ReportError as exc:
            print_line(f"distdiag: error: {exc}")
            return None
        return report if report.launch_id == self.id else None

    def noted_pids(self) -> list[int]:
        """The pids of the ranks that noted a phase (launched.note_phase)."""
        from distdiag.check.launched import read_json

        pids = []
        for name in os.listdir(self.folder):
            if name.startswith("rank-") and name.endswith(".json"):
                pid = (read_json(os.path.join(self.folder, name)) or {}).get("pid")
                if isinstance(pid, int) and pid > 0:
                    pids.append(pid)
        return pids

    def note(self) -> dict[str, Any] | None:
        return read_verdict_note(self.note_path, self.id)

    def amend_report(self, report: Report, code: int, outcome: str, note: str) -> None:
        """This run's report, its probes kept, with the code the launcher exits with (what
        happened after the verdict changed it): the file always says what the exit code says."""
        report.exit_code, report.outcome = code, outcome
        report.verdict = "error" if code == EXIT_BAD_INPUT else "fail"
        report.notes.append(note)
        try:
            write_report(report, self.report_path)
        except (OSError, ValueError):
            pass

    def leave_report(self, code: int, outcome: str, summary: str) -> None:
        """No rank wrote this run's report: leave one saying why, so that a script reading the
        file never takes an earlier run's for this one."""
        verdict = "error" if code == EXIT_BAD_INPUT else "fail"
        report = Report(world_size=self.world_size, exit_code=code, verdict=verdict, outcome=outcome, summary=summary,
                        launch_id=self.id)
        try:
            write_report(report, self.report_path)
        except (OSError, ValueError):
            pass


def signal_words(name: str) -> str:
    return "SIGINT (Ctrl-C)" if name == "SIGINT" else name


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
    from distdiag.check.launched import read_json

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
    from distdiag.check.launched import read_json

    failure = _first_failure(launch, lines)
    if not failure:
        return None
    code = int(failure["exitcode"])
    try:
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
    except ValueError:
        how = f"exit {code}"
    noted = read_json(os.path.join(launch.folder, f"rank-{failure['rank']}.json")) or {}
    doing = f" while {noted['phase']}" if noted.get("phase") else " while starting, before it imported the check"
    return f"rank {failure['rank']} (pid {failure['pid']} on host {failure['host']}) ended first ({how}){doing}"


def exit_code_after_run(launch: Launch, end: Any, lines: list[str] | None = None) -> int:
    """The launcher's exit code: this run's report's, kept only when torchrun agrees (a pass
    with torchrun failing is 3: a rank failed after the verdict); the verdict note's when its
    report could not be written; 2 for bad input said before any rank started; else 3. Says
    in one line why, when the report alone does not (`end`: launcher.JobEnd)."""
    for line in end.notes:
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
        # Bad input caught before any rank started (distdiag.check.forkrun, or torchrun's own
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


def _code_of_report(report: Report, end: Any, where: str, launch: Launch) -> int:
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
