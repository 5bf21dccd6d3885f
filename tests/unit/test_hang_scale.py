"""Hang reports at scale: rank sets compressed, stranded ranks one line per chain shape, the
culprit named alone (issue 22 item 4, issue 21 item 6). Synthetic 1024-rank incidents
(tests/unit/hang_incident.py: snapshots in the shape the watchdog writer gathers them);
timings live in benchmarks/bench_hang_scale.py, not here."""

from __future__ import annotations

import json
import re

from distdiag.hang import analyze_hang, snapshot_details
from distdiag.hang.views import coll_label
from distdiag.report.model import EXIT_HANG, ProbeResult, Report, verdict_for
from distdiag.report.render import compress_numbers, format_hosts, format_ranks
from distdiag.watchdog.writer import render_hang_report
from tests.unit.hang_incident import incident

WORLD = 1024


def test_small_sets_keep_their_form():
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "ranks 0-2,5,7-8"
    assert format_ranks([1, 3, 5]) == "ranks 1,3,5"  # too short to call a stride
    assert format_ranks([3]) == "rank 3"
    assert format_ranks([0, 1, 2, 3], world_size=4) == "all ranks"


def test_strides_and_repeated_blocks():
    assert format_ranks(list(range(7, 16384, 8))) == "ranks 7-16383 step 8"
    # one TP group's ranks minus rank 3, in every DP replica after the first
    tp_slots = [r for r in range(32, 16384) if r % 32 < 8 and r % 8 != 3]
    assert format_ranks(tp_slots) == "ranks [32-34,36-39] every 32 to 16359"
    assert compress_numbers([0, 1, 2, 4, 5, 6, 7, *range(35, 1024, 32)]) == "0-2,4-7,35-995 step 32"


def test_irregular_sets_are_cut_with_a_count():
    ranks = [r * r for r in range(40)]
    text = format_ranks(ranks)
    assert text.endswith(f",...,{ranks[-1]} (40 in all)"), text
    assert len(text) < 120
    assert _expand(compress_numbers(ranks, cut=False)) == set(ranks)  # every part: exactly them


def test_hosts_by_stem_and_number():
    assert format_hosts(["node0003"]) == "node0003"
    assert format_hosts(["node0004", "node0005", "node0006", "gpu-a"]) == "gpu-a,node[0004-0006]"
    assert format_hosts([f"node{i:04d}" for i in range(4, 2048, 4)]) == "node[0004-2044 step 4]"


def test_large_group_labels_are_compressed():
    label = "ranks[" + ",".join(str(r) for r in range(3, 16384, 32)) + "]"
    text = coll_label({"op": "all_reduce", "seq": 11, "group": label, "shape": [4], "dtype": "float32"})
    assert text == "all_reduce #11 on ranks[3-16355 step 32] (512 ranks) (float32[4])"
    small = coll_label({"op": "all_reduce", "seq": 6, "group": "ranks[0,1,2,3,4,5,6,7]", "shape": [4], "dtype": "float32"})
    assert "ranks[0,1,2,3,4,5,6,7]" in small


def _report(findings, snaps, world):
    result = ProbeResult.from_findings("watchdog", findings, details=snapshot_details(snaps))
    return Report(world_size=world, probes=[result], exit_code=EXIT_HANG, verdict=verdict_for(EXIT_HANG, [result]),
                  outcome="hang", summary=findings[0].issue)


def test_one_culprit_and_one_line_per_chain_shape():
    snaps, lost = incident(WORLD, "stall", stage=0)
    findings = analyze_hang(snaps, lost, {}, WORLD, what="step 42", timeout_s=60)
    critical = [f for f in findings if f.severity == "critical"]
    assert [f.ranks for f in critical] == [[3]], [f.issue for f in critical]
    assert "load_next_microbatch" in critical[0].issue
    stranded = next(f for f in findings if "stranded, not at fault" in f.issue)
    assert stranded.issue.startswith("ranks 0-2,4-1023 are stranded"), stranded.issue
    lines = stranded.evidence.splitlines()
    # 7 shapes: the rank's TP peers; the other stages of replica 0 (same TP slot or not);
    # every other replica through its DP all-reduce, directly or through 1 or 2 more groups
    assert len(lines) == 7, lines
    assert len({ln.split(" wait", 1)[1] for ln in lines}) == 7  # no shape twice
    counts = [int(re.search(r"(\d+) ranks?\) waits? through", ln).group(1)) for ln in lines]
    assert sum(counts) == WORLD - 1, counts
    assert all(ln.endswith("rank 3 is at /job/data.py:58 in load_next_microbatch: return next(self.iterator)") for ln in lines), lines
    dp_direct = next(ln for ln in lines if ln.startswith("ranks 35-995 step 32"))
    assert "(on 31 hosts node[0004-0124 step 4], 31 ranks) wait through all_reduce #11 on a 32-rank group" in dp_direct
    text = render_hang_report(_report(findings, snaps, WORLD))
    assert len(text.splitlines()) < 80, text
    assert max(len(ln) for ln in text.splitlines()) < 400


def test_lost_host_is_named_once_and_shapes_end_on_it():
    snaps, lost = incident(WORLD, "host", stage=1)
    findings = analyze_hang(snaps, lost, {}, WORLD, what="step 42", timeout_s=60)
    critical = [f for f in findings if f.severity == "critical"]
    assert [f.ranks for f in critical] == [list(range(8, 16))], [f.issue for f in critical]
    stranded = next(f for f in findings if "stranded, not at fault" in f.issue)
    lines = stranded.evidence.splitlines()
    assert len(lines) == 3, lines
    assert all("-> ranks 8-15 were lost (" in ln for ln in lines), lines


def test_shapes_are_capped():
    from distdiag.hang import shapes

    snaps, lost = incident(WORLD, "stall", stage=0)
    old = shapes.SHAPE_LINES
    try:
        shapes.SHAPE_LINES = 3
        findings = analyze_hang(snaps, lost, {}, WORLD, what="step 42", timeout_s=60)
    finally:
        shapes.SHAPE_LINES = old
    lines = next(f for f in findings if "stranded, not at fault" in f.issue).evidence.splitlines()
    assert len(lines) == 4 and lines[-1].startswith("... and 4 more shapes ("), lines


def test_details_hold_each_large_group_once():
    snaps, _lost = incident(WORLD, "stall", stage=0)
    details = snapshot_details(snaps)
    dp = next(k for k in details["group_members"] if k.startswith("ranks[3-995 step 32]"))
    assert details["group_members"][dp] == "ranks[" + ",".join(str(r) for r in range(3, WORLD, 32)) + "]"
    text = json.dumps(details)
    assert text.count("ranks[3,35,67,") == 1  # the full label once, not in every rank's records


def test_past_1024_ranks_stacks_are_grouped_and_the_engine_view_left_to_the_table():
    """4096 ranks: one entry per distinct stack with every rank that shares it (all of them,
    as a list), no per-rank engine view (the recorder's table holds the same positions)."""
    world = 4096
    snaps, _lost = incident(world, "stall", stage=0)
    details = snapshot_details(snaps)
    assert "stacks" not in details and "engine" not in details and "4096 ranks" in details["details_note"]
    groups = details["stacks_grouped"]
    assert sorted(r for g in groups for r in g["ranks"]) == sorted(snaps)
    culprit = next(g for g in groups if g["ranks"] == [3])
    assert culprit["count"] == 1 and culprit["about"] == "rank 3" and "load_next_microbatch" in culprit["value"][-1]
    table = details["recent_collectives_table"]
    assert "recent_collectives" not in details and len(table["by_rank"]) == len(snaps)
    assert table["columns"] == ["shared", "group", "seq", "step", "duration_s"]
    positions = details["table:collectives per group (torch's flight recorder)"]
    assert sum(row["count"] for row in positions) == 4 * len(snaps) < 4 * len(positions) * 8
    small = snapshot_details(incident(WORLD, "stall", stage=0)[0])
    assert "stacks" in small and "engine" in small and "stacks_grouped" not in small


def test_past_1024_ranks_the_flight_recorders_table_has_a_row_per_position_the_odd_ones_first():
    """4096 ranks x 4 groups: a row per group and position with exactly its ranks, the groups
    whose members disagree first, the fewest first: rank 3 at #5 (its 7 TP peers inside #6),
    then the pipeline and data-parallel groups waiting for its stage; every rank's position on
    every group is in exactly one row."""
    from distdiag.hang.views import group_members

    world = 4096
    snaps, _lost = incident(world, "stall", stage=0)
    snaps[40]["engine"]["groups"][3]["pending"]["shape"] = [512]  # its dp all_reduce, another shape
    details = snapshot_details(snaps)
    rows = details["table:collectives per group (torch's flight recorder)"]
    first = rows[0]
    assert (first["group"], first["ranks"], first["count"], first["enqueued"], first["inside"]) == (
        "ranks[0,1,2,3,4,5,6,7]", "3", 1, 5, "-")
    assert rows[1]["ranks"] == "0-2,4-7" and rows[1]["inside"].startswith("all_reduce #6")
    dp40 = [r for r in rows if r["group"] == "ranks[8-4072 step 32] (128 ranks)"]
    assert [(r["ranks"], r["count"], r["inside"].endswith("(bfloat16[512])")) for r in dp40] == [
        ("8", 1, False), ("40", 1, True), ("72-4072 step 32", 126, False)]
    names = details["group_members"]
    seen: set[tuple[str, int]] = set()
    for row in rows:
        ranks = _expand(row["ranks"])
        assert len(ranks) == row["count"] and ranks <= set(group_members(names.get(row["group"], row["group"]), world))
        assert not seen & {(row["group"], m) for m in ranks}
        seen |= {(row["group"], m) for m in ranks}
    assert len(seen) == 4 * world


def _expand(text: str) -> set[int]:
    """The ranks compress_numbers wrote (runs and strides; the table writes every part)."""
    out: set[int] = set()
    for part in text.split(","):
        span, _, step = part.partition(" step ")
        a, _, b = span.partition("-")
        out |= set(range(int(a), int(b or a) + 1, int(step or 1)))
    return out


def test_past_1024_ranks_the_recent_collectives_table_is_lossless():
    """Each rank's records rebuilt from the table (its shared fields, then its own columns,
    the group by its full label) equal the records the rank posted, in order."""
    world = 2048
    snaps, _lost = incident(world, "stall", stage=0)
    snaps[5]["recent"].append({"op": "barrier", "extra": {"nested": [1, 2]}, "seq": 9})  # no group, a nested field
    details = snapshot_details(snaps)
    table, names = details["recent_collectives_table"], details["group_members"]
    assert len(table["shared"]) < 10  # a handful of distinct calls for 2048 x 8 records
    for rank, snap in snaps.items():
        rebuilt = []
        for at, group, seq, step, duration in table["by_rank"][str(rank)]:
            record = {**table["shared"][at], "group": names.get(group, group), "seq": seq, "step": step,
                      "duration_s": duration}
            rebuilt.append({k: v for k, v in record.items() if v is not None})
        assert rebuilt == [{k: v for k, v in c.items() if v is not None} for c in snap["recent"]], rank


def test_two_groups_of_the_same_members_keep_their_own_rows():
    """A gloo twin of each TP group (the same members, a label of the same text): each group's
    position in a row of its own, named apart, every rank counted once per group. 1,056 ranks:
    past the grouping's threshold, 33 data-parallel replicas (no power of two)."""
    world = 1056
    snaps, _lost = incident(world, "stall", stage=0)
    for snap in snaps.values():
        groups = snap["engine"]["groups"]
        groups.append({**groups[1], "pg": "9", "backend": "gloo", "enqueued": 3, "started": 3, "completed": 3,
                       "pending": None})
    rows = snapshot_details(snaps)["table:collectives per group (torch's flight recorder)"]
    tp0 = [(r["group"], r["ranks"], r["count"], r["enqueued"]) for r in rows if r["group"].startswith("ranks[0,1,2,3,4,5,6,7]")]
    assert tp0 == [("ranks[0,1,2,3,4,5,6,7]", "3", 1, 5), ("ranks[0,1,2,3,4,5,6,7]", "0-2,4-7", 7, 6),
                   ("ranks[0,1,2,3,4,5,6,7] (group 2 of these ranks)", "0-7", 8, 3)]
    assert sum(r["count"] for r in rows) == 5 * world
