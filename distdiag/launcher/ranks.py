"""The ranks' side of a launch: what a rank of `distdiag check`, `distdiag gate` or `distdiag
watch` shares with the launcher that started it. In-rank code (the check's ranks, the
watchdog's writer and the `-m distdiag.watch` wrapper import it); the launcher reads what
they leave.

The launcher (launch.py, exit_code.py) must take its exit code from this run alone: a report left on disk
by an earlier run, or written by another job at the same path, must never pass for this one,
and a verdict whose report could not be written must keep its code. So it gives its ranks,
through the environment torchrun passes on:

- LAUNCH_ID_ENV: an id of its own, which every report the ranks write carries (`launch_id`);
  the launcher reads only a report with its id.
  The watchdog's hang report carries it too (`distdiag watch`).
- VERDICT_NOTE_ENV: a file in a folder of the launcher's own, where the rank that writes (or,
  on another node, copies) the report notes the verdict's code and whether the report could
  be written. It is how the launcher knows the verdict was reached (a rank stopped after it
  is then ended) and the code of a verdict that has no report. A path anywhere else (the
  variable leaked, or set by hand) is ignored: nothing is written through it. The ranks
  note their pid and phase there too (`note_phase`): the launcher's JobWatch finds a rank by
  it, and a training rank says there that its watchdog armed.

Nothing here imports torch: the command line front end uses it before any rank starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from distdiag.runtime.launchid import LAUNCH_ID_ENV, launch_id, with_this_launch_id

__all__ = [
    "ARMED_PHASE", "RETURNED_PHASE", "with_this_launch_id", "LAUNCH_ID_ENV", "VERDICT_NOTE_ENV", "LAUNCH_FOLDER_PREFIX", "launch_id", "note_verdict", "read_verdict_note", "write_bad_input_report",
    "report_path_in", "cancelled_by", "say_started", "START_PREFIX", "note_phase", "noted_rank", "forget_phase", "note_first_failure", "read_json",
]

ARMED_PHASE = "watchdog armed"
"""The phase a training rank notes once its hang watchdog runs (distdiag/watch.py): from then
on its peers' watchdogs see it stop, and the launcher leaves it to them (jobwatch.py)."""

RETURNED_PHASE = "exiting after its script returned"
"""The phase a training rank notes once the user's script returned and its watchdog closed: a
rank that dies from here on died in the interpreter's exit, not in the training."""

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


_JOB_FOLDER = re.compile(r"job-(\d+)-(\d+)-\d+-[0-9a-f]+")


def _job_folder() -> str | None:
    """Without a launcher of ours (plain torchrun): a folder per torchrun agent (the ranks'
    parent) and restart, in this user's private folder of the temp dir, where the ranks of one
    node note their phase for each other. None outside torchrun. Folders of agents that are gone
    are removed when a new one is made."""
    if not os.environ.get("TORCHELASTIC_RUN_ID") or not _folder_cache.setdefault("ok", True):
        return None
    if "job" in _folder_cache:
        return _folder_cache["job"]
    import tempfile

    import psutil

    agent = os.getppid()
    try:
        started = int(psutil.Process(agent).create_time())  # a reused pid makes another folder
    except psutil.Error:
        return None
    base = os.path.join(tempfile.gettempdir(), f"distdiag-{os.getuid()}")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    job = "/".join(os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"))
    tag = hashlib.sha256(job.encode()).hexdigest()[:12]  # one agent may run several jobs (a test's forkserver)
    folder = os.path.join(base, f"job-{agent}-{started}-{int(restart) if restart.isdigit() else 0}-{tag}")
    fresh = not os.path.isdir(folder)
    from distdiag.runtime.deathnote import own_dir

    if not (own_dir(base) and own_dir(folder)):
        _folder_cache["ok"] = False
        return None
    if fresh:
        _prune_job_folders(base)
    _folder_cache["job"] = folder
    return folder


_folder_cache: dict[str, Any] = {}


def _prune_job_folders(base: str) -> None:
    import shutil

    import psutil

    for name in os.listdir(base):
        match = _JOB_FOLDER.fullmatch(name)
        if match is None:
            continue
        try:
            alive = int(psutil.Process(int(match[1])).create_time()) == int(match[2])
        except psutil.Error:
            alive = False
        if not alive:
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)


def _rank_folder() -> str | None:
    """Where this node's ranks note their phase: the launcher's folder, else their agent's."""
    return _folder() or _job_folder()


_phase: dict[str, str] = {}


def note_phase(phase: str | None = None, *, signal: str | None = None, launcher_only: bool = False) -> None:
    """Tell the launcher, or under plain torchrun this node's other ranks, what this rank is
    doing ('importing torch and the check', 'in probe 'env'', ...) and a stop signal it got
    there (`signal`: noted while importing, distdiag/runtime/early.py): a rank lost before it
    could check in is named with it. `launcher_only`: only to a launcher of ours (a training
    rank under plain torchrun leaves no files)."""
    if phase is not None:
        _phase["phase"] = phase
    if signal is not None:
        _phase["signal"] = signal
    folder = _folder() if launcher_only else _rank_folder()
    if folder and "phase" in _phase:
        rank = os.environ.get("RANK", "0")
        _write_json(os.path.join(folder, f"rank-{rank}.json"), {**_phase, "pid": os.getpid()})


def forget_phase() -> None:
    """A clean end under plain torchrun: this rank's note goes, and the agent's folder with the last."""
    folder = _job_folder() if not _folder() else None
    if folder:
        try:
            os.unlink(os.path.join(folder, f"rank-{os.environ.get('RANK', '0')}.json"))
            os.rmdir(folder)
        except OSError:
            pass


def noted_rank(rank: int) -> dict[str, Any] | None:
    """The last note rank `rank` left (note_phase): {phase, pid[, signal]}, or None. Only the
    ranks of this node write to this launcher's (or agent's) folder, so a note found here is a
    rank on this host."""
    folder = _rank_folder()
    note = read_json(os.path.join(folder, f"rank-{rank}.json")) if folder else None
    if note is None or not isinstance(note.get("pid"), int) or not isinstance(note.get("phase"), str):
        return None
    return note


def note_first_failure(rank: int, pid: int, exitcode: int, host: str) -> None:
    """distdiag.launcher.forkrun: the rank torchrun saw fail first, for the launcher to name."""
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
