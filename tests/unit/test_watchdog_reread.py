"""The writer re-reads a snapshot that contradicts itself instead of judging it (issue 24: a
healthy job was aborted on a table showing rank 1 `in all_gather #1`, recorder `completed
-1`, while its peers were at #7). The recorder views come from torch's own flight recorder
(a 1-rank gloo group in this process), shifted to what each rank would show."""

from __future__ import annotations

import copy
import json
import threading
import time

import pytest
import torch
import torch.distributed as dist

from distdiag.runtime.exchange import Exchange
from distdiag.runtime.incident import Incident
from distdiag.runtime.keys import IncidentKeys
from distdiag.watchdog.writer import _reread, inconsistent_ranks, typed_snapshots


@pytest.fixture(scope="module")
def engine_view():
    """A real EngineReader view of the world group after 7 all_reduces."""
    from distdiag.hang.recorder import EngineReader

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for _ in range(7):
            dist.all_reduce(torch.ones(4))
        view = EngineReader().read(details=False)
    finally:
        dist.destroy_process_group()
    assert view["state"] == "ok", view
    return view


def _at(view: dict, enqueued: int, completed: int) -> dict:
    """The view with the world group's counts set as a rank at that point would show them."""
    out = copy.deepcopy(view)
    group = next(g for g in out["groups"] if g["group"] == "world")
    group["enqueued"], group["completed"] = enqueued, completed
    return out


def _snaps(view: dict) -> dict[int, dict]:
    """Rank 0 and 2 inside all_reduce #8 (completed 7); rank 1's recorder says all_gather #1."""
    return {0: {"rank": 0, "engine": _at(view, 8, 7)}, 1: {"rank": 1, "engine": _at(view, 1, -1)},
            2: {"rank": 2, "engine": _at(view, 8, 7)}}


def _rank1_answers(store, snapshot: dict) -> threading.Thread:
    """Rank 1's watchdog: once asked, it posts a new snapshot (as watcher.Watcher._handle does)."""

    def answer() -> None:
        end = time.monotonic() + 10
        while not store.check(["again/1/1"]) and time.monotonic() < end:
            time.sleep(0.01)
        store.set("snap/1/1", json.dumps({**snapshot, "reread": 1}))

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


def test_a_rank_inside_a_collective_its_peers_completed_is_inconsistent(engine_view):
    snaps = _snaps(engine_view)
    assert inconsistent_ranks(typed_snapshots(snaps)) == [1]
    snaps[1]["engine"] = _at(engine_view, 8, 7)
    assert inconsistent_ranks(typed_snapshots(snaps)) == []  # the healthy twin: everyone inside #8, nobody past it


def test_an_inconsistent_snapshot_is_re_read_and_the_new_one_used(engine_view):
    store = dist.HashStore()
    merged = _snaps(engine_view)
    thread = _rank1_answers(store, {"rank": 1, "engine": _at(engine_view, 8, 7)})
    _reread(Incident(Exchange(store, 0, 3), IncidentKeys(1), 3), merged, rank=0, own_snapshot=None, wait_s=10)
    thread.join(5)
    assert merged[1]["reread"] == 1 and merged[1]["engine"]["groups"][0]["enqueued"] == 8
    assert inconsistent_ranks(typed_snapshots(merged)) == []


def test_a_snapshot_still_inconsistent_is_not_judged_on_its_recorder(engine_view):
    """Re-read and still contradicting the others: its recorder view is set aside (state stale),
    so no rule reads `all_gather #1` from it."""
    from distdiag.hang.recorder import pending_groups

    store = dist.HashStore()
    merged = _snaps(engine_view)
    thread = _rank1_answers(store, {"rank": 1, "engine": _at(engine_view, 1, -1)})
    _reread(Incident(Exchange(store, 0, 3), IncidentKeys(1), 3), merged, rank=0, own_snapshot=None, wait_s=10)
    thread.join(5)
    assert merged[1]["engine"]["state"] == "stale" and pending_groups(merged[1]["engine"]) == []
    assert merged[0]["engine"]["state"] == "ok"


def test_a_timeout_is_excused_by_a_rank_in_a_phase_with_budget_left():
    """Rank 0 saves in a declared checkpoint phase (budget left) while the others wait: the
    declared timeout is no hang (the declaring rank had not seen the phase yet); a phase over
    its budget, another kind of event, or no phase at all keeps it."""
    from distdiag.watchdog.progress import Progress
    from distdiag.watchdog.writer import excused

    saving, waiting = Progress(history=16), Progress(history=16)
    saving.enter_phase("checkpoint", 15.0)
    snaps = {0: saving.snapshot(16), 1: waiting.snapshot(16), 2: waiting.snapshot(16)}
    timeout = {"kind": "timeout", "rank": 1}
    assert excused(timeout, typed_snapshots(snaps)).startswith("rank 0 is in phase 'checkpoint' (")
    assert excused({"kind": "desync", "rank": 1}, typed_snapshots(snaps)) is None
    over = Progress(history=16)
    over.enter_phase("eval", 0.001)
    time.sleep(0.01)
    assert excused(timeout, typed_snapshots({**snaps, 1: over.snapshot(16)})) is None
    assert excused(timeout, typed_snapshots({1: waiting.snapshot(16), 2: waiting.snapshot(16)})) is None
    importing = {**waiting.snapshot(16), "importing": True}
    assert excused(timeout, typed_snapshots({1: waiting.snapshot(16), 2: importing})) == "rank 2 is still importing modules (the job is starting)"
