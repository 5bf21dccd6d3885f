"""A rank that never posted its row of the rank table is named as never checked in, on its host
when every rank starts on one, not as "no answer from host ?" (issue 24)."""

from __future__ import annotations

from distdiag.check.finish import RunEnd
from distdiag.check.starting import with_last_notes
from distdiag.report.model import RankInfo
from distdiag.runtime.sentinel import silent_rank_reasons


def test_the_placeholder_row_of_a_rank_that_never_checked_in_is_not_taken_for_a_host():
    end = RunEnd.__new__(RunEnd)  # only the rank table is needed here
    end.rank_infos = [RankInfo(0, "vm", 0, 0, "cpu", 4341), RankInfo(1, "?", -1, -1, "?", -1)]
    infos = end._checked_in()
    assert list(infos) == [0]
    (why,) = silent_rank_reasons([1], infos, "vm", starting_host="vm").values()
    assert why.startswith("it never checked in (no rank table entry) on host vm: it was still starting"), why
    assert "host ?" not in why


def test_a_checked_in_rank_on_another_host_is_no_answer_from_that_host():
    """Healthy twin of the naming: a real row on another host still reads 'no answer from host'."""
    infos = {1: RankInfo(1, "node-b", 1, 0, "cpu", 77)}
    assert silent_rank_reasons([1], infos, "node-a") == {1: "no answer from host node-b (dead, stopped or unreachable)"}


def _launch_folder(tmp_path):
    """The launcher's own folder, as it makes it: distdiag-launch-*, mode 0700 (notes are read
    and written nowhere else)."""
    from distdiag.launcher.ranks import LAUNCH_FOLDER_PREFIX

    folder = tmp_path / f"{LAUNCH_FOLDER_PREFIX}test"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def _end(tmp_path, monkeypatch, *, local_world: int):
    from distdiag.launcher.ranks import VERDICT_NOTE_ENV
    from distdiag.runtime.context import LaunchInfo

    monkeypatch.setenv(VERDICT_NOTE_ENV, str(_launch_folder(tmp_path) / "verdict.json"))
    end = RunEnd.__new__(RunEnd)
    end.info = LaunchInfo(0, 3, 0, local_world, 0, "vm", 4341, 0, "r", "127.0.0.1", 1, True)
    end.rank_infos = [RankInfo(0, "vm", 0, 0, "cpu", 4341), RankInfo(1, "vm", 0, 1, "cpu", 4342),
                      RankInfo(2, "?", -1, -1, "?", -1)]
    return end


def test_a_rank_lost_before_checking_in_gets_host_pid_and_last_phase_from_its_note(tmp_path, monkeypatch):
    """Rank 2 noted 'connecting to the job's store' (pid 999999, long gone) to this node's
    launcher and never checked in: its row has this host and that pid, its reason says what it
    was doing and that its process is gone, and the report counts one host, not '?' as a second."""
    from distdiag.hang import state_rows
    from distdiag.report.model import Report
    from distdiag.report.render import render_report

    (_launch_folder(tmp_path) / "rank-2.json").write_text('{"phase": "connecting to the job\'s store", "pid": 999999}')
    end = _end(tmp_path, monkeypatch, local_world=1)  # not one node: only the note places rank 2
    known = end._known_rank_infos()
    assert (known[2].host, known[2].pid) == ("vm", 999999)
    lost, signalled = with_last_notes(silent_rank_reasons([2], end._checked_in(), "vm"), end._checked_in())
    assert lost[2].startswith("its process (pid 999999) is gone: killed or exited, before it checked in"), lost[2]
    assert "its last word was 'connecting to the job's store'" in lost[2] and signalled == set(), lost[2]
    (row,) = [r for r in state_rows({}, lost, 3, dict(enumerate(known))) if r["rank"] == 2]
    assert (row["host"], row["pid"], row["state"]) == ("vm", 999999, "lost")
    placeholder = Report(world_size=3, ranks=end.rank_infos, exit_code=3, verdict="fail")
    assert render_report(placeholder).splitlines()[0] == "distdiag check: 3 rank(s) on 1 host(s)"


def test_without_a_note_or_one_node_a_lost_rank_stays_unplaced(tmp_path, monkeypatch):
    """Healthy twin: nothing known about rank 2 (no note, ranks on several nodes): its row keeps
    '?' rather than a guessed host, and the table's checked-in rows are untouched."""
    from distdiag.hang import state_rows

    end = _end(tmp_path, monkeypatch, local_world=1)
    known = end._known_rank_infos()
    assert known == end.rank_infos
    rows = state_rows({}, {1: "x", 2: "y"}, 3, dict(enumerate(known)))
    assert [(r["host"], r["pid"]) for r in rows] == [("vm", 4341), ("vm", 4342), ("?", "?")]


def test_a_rank_still_importing_when_the_stop_signal_came_is_part_of_the_cancellation(tmp_path, monkeypatch):
    """Rank 2 noted SIGTERM while importing and is alive: told so, and counted as signalled (not
    lost); the same note of a process that is gone stays a lost rank's, with its pid."""
    import os

    folder = _launch_folder(tmp_path)
    end = _end(tmp_path, monkeypatch, local_world=3)
    note = '{"phase": "importing torch and the check", "pid": %d, "signal": "SIGTERM"}'
    (folder / "rank-2.json").write_text(note % os.getpid())
    lost, signalled = with_last_notes(silent_rank_reasons([2], end._checked_in(), "vm"), end._checked_in())
    assert signalled == {2} and "where it received SIGTERM" in lost[2] and "now alive" in lost[2], lost[2]
    (folder / "rank-2.json").write_text(note % 999999)
    lost, signalled = with_last_notes(silent_rank_reasons([2], end._checked_in(), "vm"), end._checked_in())
    assert signalled == {2} and lost[2].startswith("its process (pid 999999) is gone"), lost[2]
