"""One launch: its id, its private folder, its job watch, and the report of this run alone.

The ranks get the id and the folder through torchrun's environment (ranks.py); every report
they write carries the id (`launch_id`), so the launcher reads only a report with its id: a
report an earlier run left at the same path, or another job wrote there meanwhile, whatever its
file time, is never this run's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distdiag.errors import ReportError, print_line
from distdiag.launcher.jobwatch import CHECK_RULES, JobRules, JobWatch
from distdiag.launcher.ranks import LAUNCH_FOLDER_PREFIX, LAUNCH_ID_ENV, VERDICT_NOTE_ENV, read_json, read_verdict_note
from distdiag.report.model import EXIT_BAD_INPUT, Report, read_report, write_report

__all__ = ["Launch", "remove_stale_report"]


def remove_stale_report(path: str) -> None:
    """Remove the report an earlier run left at `path` (a regular file only: what stands
    behind a link is the link owner's; the launch id still keeps it from passing for ours)."""
    if os.path.isfile(path) and not os.path.islink(path):
        try:
            os.unlink(path)
        except OSError:
            pass


class Launch:
    """One launch: an id for the ranks' reports, a private folder for the verdict note, the
    cancel marker and the ranks' phase notes, the JobWatch of the job. A context manager (the
    folder goes at exit).

    `world_size`: the job's ranks, or a call that reads them (argv.world_size: only a report
    the launcher must leave itself needs them). `rules`: the JobWatch's (the check's by
    default). `remove_stale`: remove the report an earlier run left at `report_path` (the
    check's; a training job's earlier hang report stays: the launch id alone keeps it from
    passing for this run's)."""

    def __init__(self, report_path: str, world_size: int | Callable[[], int], rules: JobRules = CHECK_RULES,
                 remove_stale: bool = True) -> None:
        self.report_path = report_path
        self._world_size = world_size
        self.id = uuid.uuid4().hex
        self.folder = tempfile.mkdtemp(prefix=LAUNCH_FOLDER_PREFIX)
        self.note_path = os.path.join(self.folder, "verdict.json")
        self.watch = JobWatch(lambda: os.path.exists(self.note_path), self.noted, rules=rules)
        if remove_stale:
            remove_stale_report(report_path)

    @property
    def world_size(self) -> int:
        if callable(self._world_size):
            self._world_size = max(int(self._world_size()), 1)
        return self._world_size

    def __enter__(self) -> Launch:
        return self

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def env(self) -> dict[str, str]:
        """What the ranks must know, through torchrun's environment."""
        return {LAUNCH_ID_ENV: self.id, VERDICT_NOTE_ENV: self.note_path}

    def mark_cancelled(self, signal_name: str) -> None:
        """The user (or the scheduler) stopped us: the ranks then leave the report unprinted
        (ranks.cancelled_by), as the launcher says it in one line."""
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

    def noted(self) -> dict[int, str]:
        """{pid: phase} of the ranks that noted a phase (ranks.note_phase)."""
        found = {}
        for name in os.listdir(self.folder):
            if name.startswith("rank-") and name.endswith(".json"):
                note = read_json(os.path.join(self.folder, name)) or {}
                pid = note.get("pid")
                if isinstance(pid, int) and pid > 0:
                    found[pid] = str(note.get("phase", ""))
        return found

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
