"""The hang writer's own work at scale (issue 21: 9 s at 16,384 ranks from the declaration to
the report): each snapshot typed once, one set of views for the rules and the table, the
contradiction check linear in ranks x groups, the report serialised once, the text built
from what it shows. Each is pinned against the straightforward way it replaced: the same
ranks, findings, details and text. Timings live in benchmarks/bench_hang_scale.py."""

from __future__ import annotations

import copy
import random

import pytest

from distdiag.hang import analyze_hang, state_rows
from distdiag.hang import incident as incident_types
from distdiag.watchdog import writer
from tests.unit.hang_incident import incident

WORLD = 1024


def _pairwise(merged: dict[int, dict]) -> list[int]:
    """inconsistent_ranks as it was: every inside rank against every other member's count."""
    done: dict[str, dict[int, int]] = {}
    for rank, snap in sorted(merged.items()):
        engine = snap.get("engine") or {}
        for g in engine.get("groups", []) if engine.get("state") == "ok" else []:
            done.setdefault(g["group"], {})[rank] = g["completed"]
    out = []
    for rank, snap in sorted(merged.items()):
        engine = snap.get("engine") or {}
        for g in engine.get("groups", []) if engine.get("state") == "ok" else []:
            if g["enqueued"] > g["completed"] and any(
                    c >= g["enqueued"] for r, c in done[g["group"]].items() if r != rank):
                out.append(rank)
                break
    return out


def _random_merged(rng: random.Random, world: int) -> dict[int, dict]:
    """Ranks on a few overlapping groups with counts close together: ties for the highest, the
    rank holding the highest itself inside a later collective, a group listed twice, a recorder
    that could not be read, a rank with no recorder view."""
    groups = ["world", "ranks[0,1,2,3]", "ranks[0,2]", "ranks[1,3,5]", "ranks[4,5,6,7]"]
    merged: dict[int, dict] = {}
    for rank in range(world):
        kind = rng.random()
        if kind < 0.05:
            merged[rank] = {"rank": rank}
            continue
        mine = [{"group": g, "completed": (c := rng.randint(3, 6)), "enqueued": c + rng.choice((0, 0, 1, 2))}
                for g in rng.sample(groups, rng.randint(1, len(groups)))]
        if rng.random() < 0.1:
            mine.append({**mine[0], "completed": mine[0]["completed"] - 1})
        merged[rank] = {"rank": rank, "engine": {"state": "ok" if kind > 0.1 else "unavailable", "groups": mine}}
    return merged


def test_the_contradiction_check_finds_the_ranks_the_pairwise_one_did():
    rng = random.Random(21)
    for world in (1, 2, 3, 8, 40, 200):
        for _ in range(30):
            merged = _random_merged(rng, world)
            assert writer.inconsistent_ranks(merged) == _pairwise(merged), merged
    # the 16k-rank job's shape at 1024: nobody contradicts; then rank 8 completed dp #11 that the
    # rest of its dp group is inside (each of them contradicts), and rank 8 itself inside #12
    snaps, _lost = incident(WORLD, "stall", 0)
    assert writer.inconsistent_ranks(snaps) == _pairwise(snaps) == []
    dp = snaps[40]["engine"]["groups"][3]["group"]
    for enqueued in (11, 12):
        for g in snaps[8]["engine"]["groups"]:
            if g["group"] == dp:
                g["completed"], g["enqueued"] = 11, enqueued
        found = writer.inconsistent_ranks(snaps)
        assert found == _pairwise(snaps) and 8 not in found and found[:3] == [40, 72, 104]
    typed = writer.typed_snapshots(snaps)
    assert writer.inconsistent_ranks(typed) == found  # the typed snapshots read the same


@pytest.mark.parametrize("kind,stage", [("stall", 0), ("stall", 3), ("host", 1)])
def test_one_typing_and_one_set_of_views_give_the_same_findings_and_table(kind, stage, monkeypatch):
    """The writer types each snapshot once and the rules and the ranks' table share one set of
    views: the same findings and rows as each step reading the posted dicts on its own."""
    snaps, lost = incident(WORLD, kind, stage)
    posted = copy.deepcopy(snaps)
    findings = analyze_hang(snaps, lost, {}, WORLD, what="step 42", timeout_s=60.0)
    rows = state_rows(snaps, lost, WORLD)
    typed_calls = []
    original = incident_types.RankSnapshot.from_dict.__func__
    monkeypatch.setattr(incident_types.RankSnapshot, "from_dict",
                        classmethod(lambda cls, d: typed_calls.append(1) or original(cls, d)))
    event = {"kind": "timeout", "rank": 0, "detail": "no progress for 60s"}
    records = writer.typed_snapshots(snaps)
    assert writer.inconsistent_ranks(records) == [] and writer.excused(event, records) is None
    shared, details = writer.analyse_and_detail(event, snaps, lost, {}, WORLD, 60.0, records=records)
    assert len(typed_calls) == len(snaps)  # once per snapshot, for every step
    assert [f.to_dict() for f in shared] == [f.to_dict() for f in findings]
    assert [{k: v for k, v in r.items() if k not in ("step", "steps")} for r in details["table:ranks at the end"]] == rows
    assert snaps == posted  # nothing the writer read was changed
