"""Which ranks' long histories the hang writer reads (distdiag/watchdog/writer.py
`_history_ranks`, issue 21 item 2): all of them in a job of up to 1,024 ranks; past that, the
members of a group whose recent records disagree, and the ranks a desync event names."""

from __future__ import annotations

from distdiag.hang.records import EventKind, IncidentEvent
from distdiag.watchdog.writer import HISTORY_ALL_RANKS, _history_ranks
from tests.unit.hang_incident import groups_of, label, rank_snapshot

WORLD = 2048
TIMEOUT = IncidentEvent(EventKind.TIMEOUT, "no progress for 60s", 3)


def _snaps(world: int) -> dict[int, dict]:
    return {r: rank_snapshot(r, world, "dp") for r in range(world)}


def test_a_job_of_up_to_1024_ranks_reads_every_history():
    assert _history_ranks(TIMEOUT, _snaps(64), 64) is None
    assert HISTORY_ALL_RANKS == 1024


def test_a_large_healthy_job_reads_no_history():
    """Every rank's recent records agree: the histories would add nothing, and 16k of them
    are millions of records."""
    assert _history_ranks(TIMEOUT, _snaps(WORLD), WORLD) == set()


def test_a_group_whose_recent_records_disagree_has_its_members_histories_read():
    """Rank 35 issued another collective at dp all_reduce #11: its dp group's 64 members."""
    snaps = _snaps(WORLD)
    snaps[35]["recent"][-1] = dict(snaps[35]["recent"][-1], fp="broadcast|(8,)|float32|train.py:7 in f")
    dp = groups_of(35, WORLD)["dp"]
    assert snaps[35]["recent"][-1]["group"] == label("dp", dp)
    assert _history_ranks(TIMEOUT, snaps, WORLD) == set(dp)


def test_a_desync_event_has_its_ranks_and_group_read():
    dp = groups_of(3, WORLD)["dp"]
    event = IncidentEvent(EventKind.DESYNC, {"group": label("dp", dp), "step": 4, "rank": 3, "ref": 35, "mine": 9, "theirs": 8}, 3)
    assert _history_ranks(event, _snaps(WORLD), WORLD) == set(dp) | {3, 35}
