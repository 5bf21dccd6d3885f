"""The hang writer's own work at scale (issue 21: 9 s at 16,384 ranks from the declaration to
the report): each snapshot typed once, one set of views for the rules and the table, the
contradiction check linear in ranks x groups, the report serialised once, the text built
from what it shows. Each is pinned against the straightforward way it replaced: the same
ranks, findings, details and text. Timings live in benchmarks/bench_hang_scale.py."""

from __future__ import annotations

import copy
import dataclasses
import json
import random

import pytest
import torch.distributed as dist

from distdiag.hang import analyze_hang, state_rows
from distdiag.hang import records as incident_types
from distdiag.report import render
from distdiag.report.model import EXIT_HANG, Finding, ProbeResult, RankInfo, Report, verdict_for
from distdiag.runtime.exchange import Exchange
from distdiag.runtime.incident import Incident, Seat
from distdiag.runtime.keys import IncidentKeys
from distdiag.watchdog import writer
from tests.unit.hang_incident import incident

WORLD = 1024


def _pairwise(merged: dict[int, dict]) -> list[int]:
    """inconsistent_ranks by definition: an inside rank against every other member's count
    (inconsistent when every other member completed its collective)."""
    done: dict[str, dict[int, int]] = {}
    for rank, snap in sorted(merged.items()):
        engine = snap.get("engine") or {}
        for g in engine.get("groups", []) if engine.get("state") == "ok" else []:
            done.setdefault(g["group"], {})[rank] = g["completed"]
    out = []
    for rank, snap in sorted(merged.items()):
        engine = snap.get("engine") or {}
        for g in engine.get("groups", []) if engine.get("state") == "ok" else []:
            others = [c for r, c in done[g["group"]].items() if r != rank]
            if g["enqueued"] > g["completed"] and others and all(c >= g["enqueued"] for c in others):
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
            assert writer.inconsistent_ranks(writer.typed_snapshots(merged)) == _pairwise(merged), merged
    # the 16k-rank job's shape at 1024: nobody contradicts; then rank 8 completed dp #11 that the
    # rest of its dp group is inside: no contradiction (a broadcast's root may complete first,
    # and they may wait for one another); then every member but rank 40 completed it: rank 40
    # contradicts them (nobody left to wait for), and not when it is inside #12
    snaps, _lost = incident(WORLD, "stall", 0)
    assert writer.inconsistent_ranks(writer.typed_snapshots(snaps)) == _pairwise(snaps) == []
    dp = snaps[40]["engine"]["groups"][3]["group"]
    for g in snaps[8]["engine"]["groups"]:
        if g["group"] == dp:
            g["completed"], g["enqueued"] = 11, 11
    assert writer.inconsistent_ranks(writer.typed_snapshots(snaps)) == _pairwise(snaps) == []
    members = [r for r, s in snaps.items() if any(g["group"] == dp for g in (s.get("engine") or {}).get("groups", []))]
    for r in members:
        for g in snaps[r]["engine"]["groups"]:
            if g["group"] == dp:
                g["completed"], g["enqueued"] = (10, 11) if r == 40 else (11, 11)
    for enqueued in (11, 12):
        for g in snaps[40]["engine"]["groups"]:
            if g["group"] == dp:
                g["enqueued"] = enqueued
        found = writer.inconsistent_ranks(writer.typed_snapshots(snaps))
        assert found == _pairwise(snaps) and found == ([40] if enqueued == 11 else [])
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


def test_findings_and_rank_rows_serialise_as_the_dataclasses_do():
    """The explicit to_dict of Finding and RankInfo: every field, in field order, the same values
    as dataclasses.asdict (drain and cause left out when unset, as before)."""
    full = Finding(severity="error", issue="i", evidence="e", ranks=[3, 1], fix="f", confidence=0.5,
                   drain={"host": "node-a", "device": {"index": 1}}, cause="uneven_data")
    assert full.to_dict() == dataclasses.asdict(full)
    assert list(full.to_dict()) == [f.name for f in dataclasses.fields(Finding)]
    assert full.to_dict()["drain"] is not full.drain and full.to_dict()["ranks"] is not full.ranks
    bare = Finding(severity="info", issue="i")
    assert bare.to_dict() == {k: v for k, v in dataclasses.asdict(bare).items() if k not in ("drain", "cause")}
    info = RankInfo(5, "node-b", 1, 1, "cuda:1", 4242)
    assert info.to_dict() == dataclasses.asdict(info) and list(info.to_dict()) == [f.name for f in dataclasses.fields(RankInfo)]


def _hang_report(world: int, hosts: list[str]) -> Report:
    snaps, lost = incident(world, "stall", 0)
    event = {"kind": "timeout", "rank": 0, "detail": "no progress for 60s"}
    findings, details = writer.analyse_and_detail(event, snaps, lost, {}, world, 60.0)
    result = ProbeResult.from_findings("watchdog", findings, details=details, duration_s=1.25)
    ranks = [RankInfo(r, hosts[r % len(hosts)], r // 8, r % 8, "cpu", 100 + r) for r in range(world)]
    return Report(world_size=world, probes=[result], ranks=ranks, exit_code=EXIT_HANG,
                  verdict=verdict_for(EXIT_HANG, [result]), outcome="hang", summary=findings[0].issue)


def test_the_text_reads_only_what_it_shows(monkeypatch):
    """The text is built without the rank table's and by_node's copies: the same text as from
    the whole report's dict; hosts counted as printed, a rank nobody placed ('?') no host."""
    report = _hang_report(WORLD, ["node-a", "node-b\x1b[2J", "?", ""])
    text = render.render_report(report)
    monkeypatch.setattr(render, "_shown_dict", lambda r: r.to_dict())
    assert render.render_report(report) == text
    assert text.splitlines()[0] == f"distdiag check: {WORLD} rank(s) on 2 host(s)"
    assert "table:" not in text and "... 1012 more row(s)" in text


def test_the_shared_copy_is_the_written_file_serialised_once(tmp_path, monkeypatch):
    """The writer serialises the report once: the file and the other hosts' copy are one text."""
    report = _hang_report(64, [f"node{i}" for i in range(8)])
    calls = []
    to_json = Report.to_json
    monkeypatch.setattr(Report, "to_json", lambda self: calls.append(1) or to_json(self))
    store = dist.HashStore()
    keys = IncidentKeys(1)
    writer._write_and_print(report, dump_dir=str(tmp_path))
    writer.publish_outcome(Incident(Exchange(store, 0, 64), keys, 64, seat=Seat("node0", 0, 0, 8)), report, excuse=None,
                           dump_dir=str(tmp_path))
    text, meta = Incident(Exchange(store, 9, 64), keys, 64).wait_report(5.0)
    assert calls == [1] and meta["host"] == "node0"
    assert text + "\n" == (tmp_path / writer.REPORT_NAME).read_text()
    assert json.loads(text)["summary"] == report.summary
