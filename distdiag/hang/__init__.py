"""Why a run stopped making progress: hang analysis shared by the check and the watchdog.

    records.py   the incident, typed: a rank's snapshot, the event, why a rank is silent, the
                 verdict, and the findings' causes the rules decide on
    groupid.py   a process group as reports name it (members, desc, name): its label
                 ('world', 'ranks[0,2] (DP)') and the one parser of labels
    views.py     each rank's snapshot read into where it waits (torch's flight recorder
                 first, our wrappers for call sites), the per-rank table, the details
    rules.py     the ordered rules (raised, lost, behind, desync..., stall, nobody waiting)
    waitfor.py   the wait-for graph across groups: who waits for whom, where the chains end
                 (the culprits), the stranded ranks' chains, cycles (deadlocks)
    group_rules.py  the rules that read the graph: uneven data, deadlock, stranded
    picture.py   the wait-for graph as plain data in the report (`wait_for_graph`), drawn as
                 Graphviz DOT or Mermaid by `distdiag hang-report --graph`
    drawing.py   the same graph as an image (matplotlib, optional), laid out in columns by hand
    shapes.py    stranded ranks at scale: one line per chain shape, with their hosts and a count
    desync.py    desyncs from fingerprint histories and from the recorder's entries; with two
                 ranks, the one that departs from its own history
    desync_rules.py  the desync rules (in flight, in the recorder's entries, in histories)
    fixes.py     what to do about exceptions distributed jobs raise often
    recorder.py  torch's flight recorder read live (per-group enqueued/started/completed) or
                 from dumps: the positions the rules read first
    dumps.py     dump files as torch writes them (pickle read with no globals, JSON), checked
    plainpickle.py  an untrusted pickle read as plain data, its memo, size, depth and time bounded
    dumpgroups.py  one rank's dump normalised: groups by members, ops, positions, peers
    frontier.py  who holds a dumped job up, from the recorder's semantics: per group the
                 frontier and who never entered it, each rank's oldest unfinished op, send/recv
                 paired by peer, stale discovery; the chains of waits and where they end
    dumpblame.py the findings of a dumped job: culprits at the ends, stranded ranks apart
    dumpreport.py  a hang report from the dumps in a folder (`distdiag hang-report DIR`)

May import distdiag.report and distdiag.errors only; recorder.py imports torch when it reads.
"""

from __future__ import annotations

from distdiag.hang.desync import (
    SHAPE_FREE_OPS,
    desync_finding,
    find_desync,
    first_divergence,
    record_desync_finding,
    record_divergence,
)
from distdiag.hang.rules import RULES, Analysis, analyze_hang, ensure_critical
from distdiag.hang.views import (
    RankView,
    build_views,
    coll_label,
    rank_state,
    snapshot_details,
    stack_text,
    state_rows,
    where,
)
from distdiag.hang.waitfor import End, Node, Wait, WaitGraph, build_graph, nodes_from_positions, nodes_from_views

__all__ = [
    "analyze_hang", "ensure_critical", "Analysis", "RULES",
    "Wait", "Node", "End", "WaitGraph", "build_graph", "nodes_from_views", "nodes_from_positions",
    "RankView", "build_views", "rank_state", "state_rows", "snapshot_details", "stack_text", "where", "coll_label",
    "SHAPE_FREE_OPS", "find_desync", "desync_finding", "first_divergence", "record_divergence", "record_desync_finding",
]
