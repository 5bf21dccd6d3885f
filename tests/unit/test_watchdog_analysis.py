"""Desync location from fingerprint histories, config validation, the digest (pure, no torch group)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from distdiag.errors import ConfigError
from distdiag.hang import desync_finding, find_desync
from distdiag.watchdog.config import WatchdogConfig
from distdiag.watchdog.progress import Progress


def rec(seq, site, op="all_reduce", shape=(16,), step=0, group="world"):
    return {"op": op, "seq": seq, "group": group, "shape": list(shape), "dtype": "float32", "call_site": site, "step": step}


def program(sites, start=1, step_of=lambda i: i // 3):
    return [rec(start + i, s, step=step_of(i)) for i, s in enumerate(sites)]


def snaps_of(histories):
    return {r: {"history": h, "in_collective": None, "phase": "training", "stack": []} for r, h in histories.items()}


GOOD = ["t.py:A", "t.py:B", "t.py:C"] * 4


def test_skip_is_located_with_both_sites_and_step():
    skipped = GOOD[:7] + GOOD[8:]  # rank 1 leaves out B of step 2
    d = find_desync(snaps_of({0: program(GOOD), 1: program(skipped), 2: program(GOOD)}))
    assert d["kind"] == "skipped" and d["odd"] == [1] and d["seq"] == 8
    f = desync_finding(d)
    assert f.ranks == [1] and "t.py:B" in f.issue and "t.py:C" in f.issue and "step 2" in f.issue


def test_extra_same_shape_is_located():
    extra = GOOD[:8] + ["t.py:X"] + GOOD[8:]
    d = find_desync(snaps_of({0: program(GOOD), 1: program(GOOD), 2: program(extra)}))
    assert d["kind"] == "extra" and d["odd"] == [2] and d["seq"] == 9
    assert "t.py:X" in desync_finding(d).issue


def test_different_op_is_a_mismatch():
    other = program(GOOD)
    other[4] = rec(5, "t.py:B", op="all_gather", step=1)
    d = find_desync(snaps_of({0: program(GOOD), 1: other, 2: program(GOOD)}))
    assert d["kind"] == "mismatch" and d["odd"] == [1] and "all_gather" in desync_finding(d).issue


def test_rank_dependent_call_site_alone_is_not_a_desync():
    """`if rank == 0: broadcast(...) else: broadcast(...)` on two lines pairs fine: no finding."""
    other = program(GOOD)
    other[3] = rec(4, "t.py:A_else", step=1)
    assert find_desync(snaps_of({0: program(GOOD), 1: other, 2: program(GOOD)})) is None


def test_a_rank_that_is_only_behind_is_not_a_desync():
    assert find_desync(snaps_of({0: program(GOOD), 1: program(GOOD[:5])})) is None


def test_digest_ignores_call_sites_but_counts_collectives():
    a, b = Progress(64), Progress(64)
    for p, site in ((a, "x.py:1"), (b, "y.py:9")):
        r = p.begin("all_reduce", "world", (4,), "float32", site, False)
        p.end(r)
        p.mark_step(0)
    assert a.marks[-1][2] == b.marks[-1][2]
    r = b.begin("all_reduce", "world", (4,), "float32", "y.py:9", False)
    b.end(r)
    a.mark_step(1)
    b.mark_step(1)
    assert a.marks[-1][2] != b.marks[-1][2]


@pytest.mark.parametrize(
    "kwargs,key",
    [({"timeout": timedelta(0)}, "watchdog.timeout"), ({"action": "explode"}, "watchdog.action"), ({"history": 3}, "watchdog.history")],
)
def test_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        WatchdogConfig(**kwargs)


def test_env_fills_what_arguments_leave_out(monkeypatch):
    monkeypatch.setenv("DISTDIAG_WATCHDOG_TIMEOUT_S", "7")
    monkeypatch.setenv("DISTDIAG_WATCHDOG_ACTION", "report")
    cfg = WatchdogConfig.from_env(action="raise")
    assert cfg.timeout_s == 7 and cfg.action == "raise"
    monkeypatch.setenv("DISTDIAG_WATCHDOG_TIMEOUT_S", "soon")
    with pytest.raises(ConfigError, match="DISTDIAG_WATCHDOG_TIMEOUT_S"):
        WatchdogConfig.from_env()


def test_importing_the_package_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, distdiag, distdiag.watchdog; distdiag.HangWatchdog; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


class _Recorder:
    """What StallCheck reads of distdiag.hang.recorder.EngineReader: one group, its counts."""

    available = True

    def __init__(self) -> None:
        self.enqueued = self.completed = 5

    @property
    def completed_total(self) -> int:
        return self.completed

    age_s = 1.0
    """How long ago the open collective (enqueued > completed) was issued, as details give it."""

    def read(self, details: bool = False) -> dict:
        group = {"group": "world", "enqueued": self.enqueued, "completed": self.completed}
        if details and self.enqueued > self.completed:
            group["pending"] = {"seq": self.enqueued, "for_s": self.age_s}
        return {"state": "ok", "groups": [group]}


def _stall(timeout_s: float = 3.0):
    """A StallCheck of rank 0 of 2, and a real (in-process) store where no peer is in a phase."""
    import torch.distributed as dist

    from distdiag.runtime.exchange import Exchange
    from distdiag.watchdog.phases import PhaseBoard
    from distdiag.watchdog.stall import StallCheck

    progress = Progress(history=16)
    check = StallCheck(0, progress, WatchdogConfig(timeout=timedelta(seconds=timeout_s)), PhaseBoard(0, 2, progress))
    store = dist.HashStore()
    for rank in (0, 1):
        store.set(f"phase/{rank}", "{}")
        Exchange(store, rank, 2).post("info", {"rank": rank})  # both watchdogs checked in
    return progress, check, Exchange(store, 0, 2)


def test_a_peer_not_checked_in_excuses_the_wait_within_the_startup_budget():
    """Rank 1's watchdog never checked in (still importing torch on a busy machine): rank 0,
    waiting past the timeout, is not hung while its startup budget lasts; it is after."""
    import torch.distributed as dist

    from distdiag.runtime.exchange import Exchange
    from distdiag.watchdog.phases import PhaseBoard
    from distdiag.watchdog.stall import StallCheck

    progress = Progress(history=16)
    config = WatchdogConfig(timeout=timedelta(seconds=3), startup_timeout=timedelta(seconds=60))
    check = StallCheck(0, progress, config, PhaseBoard(0, 2, progress))
    store = dist.HashStore()
    ex = Exchange(store, 0, 2)
    check.phase_board.start(ex)
    ex.post("info", {"rank": 0})
    rec = progress.begin("all_reduce", "0", (4,), "float32", "train.py:1", False)
    rec.t0 -= 3.5
    progress.last_progress -= 3.5
    assert check.overdue(ex, 0.0) is None
    check.phase_board.started -= 61  # the startup budget ran out: now it is a hang
    check.excused = 0.0
    assert "made no progress" in check.overdue(ex, 0.0)


def test_an_import_in_the_training_thread_is_published_as_a_phase(tmp_path, monkeypatch):
    """A thread inside an import (a module whose body waits for a file) is `importing`; the
    board publishes an `import` phase for it, which a waiting peer reads as an excuse."""
    import threading
    import time

    import torch.distributed as dist

    from distdiag.runtime.exchange import Exchange
    from distdiag.watchdog.phases import PhaseBoard, importing

    done = tmp_path / "done"
    body = f"import os, time\nend = time.monotonic() + 30\nwhile not os.path.exists({str(done)!r}) and time.monotonic() < end:\n    time.sleep(0.01)\n"
    (tmp_path / "wd_slow_import.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    thread = threading.Thread(target=lambda: __import__("wd_slow_import"), daemon=True)
    thread.start()
    store = dist.HashStore()
    try:
        end = time.monotonic() + 20
        while not importing(thread.ident) and time.monotonic() < end:
            time.sleep(0.01)
        assert importing(thread.ident)
        progress = Progress(history=16, thread_ident=thread.ident)
        board = PhaseBoard(1, 2, progress)
        board.start(Exchange(store, 1, 2))
        board.publish(Exchange(store, 1, 2), 600.0)
        peer = PhaseBoard(0, 2, Progress(history=16))
        peer.start(Exchange(store, 0, 2))
        assert peer.peer_in_phase(Exchange(store, 0, 2)) == "rank 1 in phase 'import'"
    finally:
        done.write_text("")
        thread.join(10)
    assert not importing(threading.get_ident())


def test_a_wait_counts_from_when_it_began_not_from_the_last_progress():
    """Long compute past the timeout, then a collective a peer has not reached yet: not hung
    until this rank has waited the timeout (the zero-code FSDP twin was once killed here)."""
    progress, check, ex = _stall()
    progress.last_progress -= 10.0  # 10 s of compute since the last progress
    rec = progress.begin("all_reduce", "0", (4,), "float32", "train.py:1", False)
    assert check.overdue(ex, 0.0) is None
    rec.t0 -= 3.5
    assert "made no progress for 3.5s (timeout 3s)" in check.overdue(ex, 0.0)


def test_a_wait_the_recorder_sees_counts_from_the_first_tick_that_saw_it():
    progress, check, ex = _stall()
    recorder = _Recorder()
    check.start(recorder)
    check.read_engine()  # the first reading of the counts
    progress.last_progress -= 10.0  # 10 s of compute since the last progress of any kind
    check.engine_progress -= 10.0
    recorder.enqueued += 1  # FSDP's all-gather of the next step, issued by torch
    check.read_engine()
    assert check.engine_pending and check.overdue(ex, 0.0) is None
    check.pending_since -= 4.0
    assert "made no progress for 4.0s" in check.overdue(ex, 0.0)
    recorder.completed += 1  # it completed: progress, and no wait any more
    check.read_engine()
    assert not check.engine_pending and check.overdue(ex, 0.0) is None


def test_a_collective_the_peers_completed_is_not_a_wait_when_the_recorder_lags():
    """gloo marks completion late: rank 0's recorder shows FSDP's reduce-scatter (#6) open for
    seconds while rank 1 completed it and both compute. Not a hang; while rank 1 has not, it is."""
    progress, check, ex = _stall()
    recorder = _Recorder()
    check.start(recorder)
    check.read_engine(ex)
    progress.last_progress -= 10.0
    check.engine_progress -= 10.0
    recorder.enqueued += 1
    check.read_engine(ex)
    check.pending_since -= 4.0
    ex.store.set("eng/1", '{"world": 5}')  # rank 1 has not completed #6: rank 0 waits on it
    assert "made no progress for 4.0s" in check.overdue(ex, 0.0)
    ex.store.set("eng/1", '{"world": 6}')  # rank 1 completed #6: rank 0's record lags
    assert check.overdue(ex, 0.0) is None


def test_action_raise_calls_a_rank_blocked_only_in_a_collective_no_peer_completed():
    """action='raise' ends a rank blocked in a collective instead of raising in it: gloo's
    recorder can show this rank's last collective (#6) open while it spins in Python code
    after it; a peer that completed #6 says it is not blocked (the fault test once saw exit 3)."""
    progress, check, ex = _stall()
    recorder = _Recorder()
    check.start(recorder)
    check.read_engine(ex)
    recorder.enqueued += 1  # #6 returned, but the recorder still shows it open
    ex.store.set("eng/1", '{"world": 5}')  # rank 1 has not completed #6: rank 0 waits in it
    assert check.blocked_in_collective(ex)
    ex.store.set("eng/1", '{"world": 6}')  # rank 1 completed #6: rank 0's record lags
    assert not check.blocked_in_collective(ex)
    ex.store.set("eng/1", '{"world": 5}')  # both recorders lag (seen too): no peer completed #6
    progress.mark_step(3)  # ...but this rank began step 3 after issuing #6: it is past it
    assert not check.blocked_in_collective(ex)
    recorder.age_s = 0.0  # #6 issued after the step began: the rank may wait in it
    assert check.blocked_in_collective(ex)
    recorder.completed += 1  # read afresh, not as of the last tick
    assert not check.blocked_in_collective(ex)
    progress.begin("all_reduce", "0", (4,), "float32", "train.py:1", False)  # a wrapper sees the wait
    assert check.blocked_in_collective(ex)


def test_completed_counts_are_published_when_they_change_at_most_every_quarter_timeout():
    progress, check, ex = _stall(timeout_s=4.0)
    recorder = _Recorder()
    check.start(recorder)
    check.read_engine(ex)
    assert ex.store.get("eng/0") == b'{"world": 5}'
    recorder.enqueued = recorder.completed = 6
    check.read_engine(ex)  # changed, but published a moment ago: not yet
    assert ex.store.get("eng/0") == b'{"world": 5}'
    check._published = (check._published[0], check._published[1] - 1.0)  # a quarter timeout later
    check.read_engine(ex)
    assert ex.store.get("eng/0") == b'{"world": 6}'
