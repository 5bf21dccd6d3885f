"""What a rank of `distdiag check` / `distdiag gate` shares with the launcher that started it.

The launcher (launcher.py) must take its exit code from this run alone: a report left on disk
by an earlier run, or written by another job at the same path, must never pass for this one,
and a verdict whose report could not be written must keep its code. So it gives its ranks,
through the environment torchrun passes on:

- LAUNCH_ID_ENV: an id of its own, which every report the ranks write carries (`launch_id`);
  the launcher reads only a report with its id.
- VERDICT_NOTE_ENV: a file in a folder of the launcher's own, where the rank that writes (or,
  on another node, copies) the report notes the verdict's code and whether the report could
  be written. It is how the launcher knows the verdict was reached (a rank stopped after it
  is then ended) and the code of a verdict that has no report. A path anywhere else (the
  variable leaked, or set by hand) is ignored: nothing is written through it.

Nothing here imports torch: the command line front end uses it before any rank starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "LAUNCH_ID_ENV", "VERDICT_NOTE_ENV", "LAUNCH_FOLDER_PREFIX", "launch_id", "note_verdict", "read_verdict_note", "write_bad_input_report",
    "report_path_in", "cancelled_by", "say_started", "START_PREFIX", "note_phase", "noted_rank", "note_first_failure", "read_json",
]

LAUNCH_ID_ENV = "DISTDIAG_LAUNCH_ID"
VERDICT_NOTE_ENV = "DISTDIAG_VERDICT_NOTE"


START_PREFIX = "distdiag check: starting "
"""The start line's beginning (the launcher shows it as it comes: report/render.py is_beat_line)."""


def say_started(config: Any, nproc: int) -> None:
    """A sign of life before the ranks spend seconds importing torch: one line on stderr, once
    the command line is known good (a bad one stays one line), not with --quiet or json."""
    if config.quiet or config.format != "text":
        return
    from distdiag.errors import print_line

    print_line(f"{START_PREFIX}{nproc} rank(s) on this machine; each probe has {config.timeout_s:g} s, "
               f"the check {config.deadline_s:g} s")


def launch_id() -> str:
    """This process's launch id ('' when no distdiag launcher started it)."""
    return os.environ.get(LAUNCH_ID_ENV, "")


LAUNCH_FOLDER_PREFIX = "distdiag-launch-"
"""The launcher's folder (tempfile.mkdtemp: this user's, mode 0700) starts with this."""


def _note_path() -> str | None:
    """VERDICT_NOTE_ENV when it names a file in a launcher's own folder (a directory named
    distdiag-launch-*, this user's, open to nobody else, as tempfile.mkdtemp makes it); else
    None. The variable may have leaked into another job's environment or been set by hand to
    any file of the user's: nothing is ever written through it then."""
    import stat

    path = os.environ.get(VERDICT_NOTE_ENV)
    if not path:
        return None
    folder = os.path.dirname(os.path.abspath(path))
    try:
        st = os.lstat(folder)
    except OSError:
        return None
    if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077
            or not os.path.basename(folder).startswith(LAUNCH_FOLDER_PREFIX)):
        return None
    return path


def note_verdict(exit_code: int, report_written: bool) -> None:
    """Tell the launcher (if any) the verdict's code and whether the report is on disk.

    Best effort: the note's folder belongs to the launcher, which may be gone already."""
    path = _note_path()
    if not path:
        return
    _write_json(path, {"launch_id": launch_id(), "exit_code": int(exit_code), "report_written": bool(report_written)})


def _folder() -> str | None:
    path = _note_path()
    return os.path.dirname(path) if path else None


def _write_json(path: str, value: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        Path(tmp).write_text(json.dumps(value), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


def read_json(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def note_phase(phase: str) -> None:
    """Tell the launcher what this rank is doing ('importing torch and the check', 'in probe
    'env'', ...): a rank lost before the ranks could report is named with it."""
    folder = _folder()
    if folder:
        rank = os.environ.get("RANK", "0")
        _write_json(os.path.join(folder, f"rank-{rank}.json"), {"phase": phase, "pid": os.getpid()})


def noted_rank(rank: int) -> dict[str, Any] | None:
    """The last note rank `rank` left this process's launcher (note_phase): {phase, pid}, or
    None. Only the ranks of this node write to this launcher's folder, so a note found here
    is a rank on this host."""
    folder = _folder()
    note = read_json(os.path.join(folder, f"rank-{rank}.json")) if folder else None
    if note is None or not isinstance(note.get("pid"), int) or not isinstance(note.get("phase"), str):
        return None
    return note


def note_first_failure(rank: int, pid: int, exitcode: int, host: str) -> None:
    """distdiag.check.forkrun: the rank torchrun saw fail first, for the launcher to name."""
    folder = _folder()
    if folder:
        _write_json(os.path.join(folder, "first_failure.json"),
                    {"rank": rank, "pid": pid, "exitcode": exitcode, "host": host})


def cancelled_by() -> str | None:
    """The signal the launcher got from the user (SIGINT: Ctrl-C), once it forwarded it; the
    launcher then says the cancellation in one line, and the ranks print no report."""
    path = _note_path()
    if not path:
        return None
    try:
        return Path(f"{path}.cancel").read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def read_verdict_note(path: str | os.PathLike[str], expected_id: str) -> dict[str, Any] | None:
    """The note a rank left for launch `expected_id`, or None (none yet, or not ours)."""
    note = read_json(path)
    if note is None or note.get("launch_id") != expected_id or not isinstance(note.get("exit_code"), int):
        return None
    return note


def report_path_in(argv: list[str], default: str = "distdiag-report.json") -> str:
    """The --report path of a check command line, else `default` (for bad input, when the
    command line could not be parsed to the end)."""
    path = default
    for i, arg in enumerate(argv):
        if arg == "--report" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--report="):
            path = arg.split("=", 1)[1]
    return path


def write_bad_input_report(message: str, report_path: str, world_size: int) -> bool:
    """Leave a report saying nothing ran (exit 2) where the check's report goes, replacing
    one an earlier run left there; False when it cannot be written (the bad input may be
    that very path: the one line on stderr says so)."""
    from distdiag.report.model import EXIT_BAD_INPUT, Report, write_report

    report = Report(
        world_size=max(int(world_size), 1), exit_code=EXIT_BAD_INPUT, verdict="error", outcome="bad_input",
        summary=message, launch_id=launch_id(),
    )
    try:
        write_report(report, report_path)
    except (OSError, ValueError):
        return False
    return True
