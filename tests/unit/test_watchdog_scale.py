"""The watchdog's store reads stay O(group) or O(1) per rank in a large world (issue 21 item 3):
a rank whose wait only the recorder shows reads the counts of its open group's members only,
and a rank checking for peers in a declared phase reads the one that entered last first. A
real store in this process (HashStore), with a wrapper that records the keys each request
carried."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from distdiag.runtime.exchange import BATCH, Exchange
from distdiag.watchdog.config import WatchdogConfig
from distdiag.watchdog.phases import PhaseBoard
from distdiag.watchdog.progress import Progress
from distdiag.watchdog.stall import StallCheck, group_members

WORLD = 4096


class Keys:
    """The real store, recording every key a request carried."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.keys: list[str] = []
        self.requests = 0

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.store, name)

        def call(*args: Any) -> Any:
            self.requests += 1
            if args:
                self.keys += args[0] if isinstance(args[0], list) else [args[0]]
            return fn(*args)

        return call


class _Recorder:
    """What StallCheck reads of EngineReader: rank 40's TP group open at #6 (TP=8)."""

    available = True
    completed_total = 5

    def read(self, details: bool = False) -> dict:
        return {"state": "ok", "groups": [{"group": "ranks[40,41,42,43,44,45,46,47]", "enqueued": 6, "completed": 5}]}


def test_group_members_from_labels():
    assert group_members("ranks[0,8,16]", 32) == [0, 8, 16]
    assert group_members("ranks[1,3] (cuda)", 4) == [1, 3]
    assert group_members("world", 3) == [0, 1, 2]
    assert group_members("group 7", 2) == [0, 1]


def _stall(store: Any) -> tuple[Progress, StallCheck, Exchange]:
    progress = Progress(history=16)
    check = StallCheck(40, progress, WatchdogConfig(timeout=timedelta(seconds=3)), PhaseBoard(40, WORLD, progress))
    check.start(_Recorder())
    check.read_engine()
    return progress, check, Exchange(store, 40, WORLD)


def test_a_lagging_recorder_is_told_by_the_open_groups_members_alone():
    base = dist.HashStore()
    for r in range(WORLD):
        base.set(f"eng/{r}", '{"ranks[40,41,42,43,44,45,46,47]": 6}')  # every rank completed #6
    store = Keys(base)
    _progress, check, ex = _stall(store)
    assert check._recorder_lags(ex)
    read = {k for k in store.keys if k.startswith("eng/")}
    assert read == {f"eng/{r}" for r in range(41, 48)}, sorted(read)[:20]


def test_a_world_group_reads_a_spread_sample_not_every_peer():
    base = dist.HashStore()
    for r in range(1, WORLD):
        base.set(f"eng/{r}", '{"world": 6}')
    store = Keys(base)
    progress = Progress(history=16)
    check = StallCheck(0, progress, WatchdogConfig(timeout=timedelta(seconds=3)), PhaseBoard(0, WORLD, progress))
    check._pending = {"world": 6}
    assert check._recorder_lags(Exchange(store, 0, WORLD))
    read = {k for k in store.keys if k.startswith("eng/")}
    assert len(read) <= BATCH and max(int(k[4:]) for k in read) > WORLD / 2


def test_a_peer_in_a_phase_is_found_with_a_few_reads():
    base = dist.HashStore()
    for r in range(WORLD):
        PhaseBoard(r, WORLD, Progress(history=16)).start(Exchange(base, r, WORLD))
    progress = Progress(history=16)
    progress.enter_phase("checkpoint", 600.0)
    board = PhaseBoard(3000, WORLD, progress)
    board.publish(Exchange(base, 3000, WORLD))
    store = Keys(base)
    peer = PhaseBoard(7, WORLD, Progress(history=16))
    assert peer.peer_in_phase(Exchange(store, 7, WORLD)) == "rank 3000 in phase 'checkpoint'"
    assert len(store.keys) <= 6, store.keys
    progress.exit_phase("checkpoint")
    board.publish(Exchange(base, 3000, WORLD))
    store.keys.clear()
    assert peer.peer_in_phase(Exchange(store, 7, WORLD)) is None and len(store.keys) <= 2


def test_a_peer_still_starting_is_named_with_one_presence_read():
    base = dist.HashStore()
    for r in range(WORLD):
        if r != 2500:
            Exchange(base, r, WORLD).post("info", {"rank": r})
    store = Keys(base)
    board = PhaseBoard(0, WORLD, Progress(history=16))
    assert board.peer_starting(Exchange(store, 0, WORLD), 60.0) == "rank 2500 still starting (its watchdog has not checked in)"
    # one check per BATCH keys, halved down to the silent rank: not a round trip per rank
    assert store.requests <= 2 + WORLD // BATCH + 2 * 8, store.requests
