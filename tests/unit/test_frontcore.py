"""One model for live snapshots and dumps: per group the frontier and who never entered it.

hang/frontcore.py decides, for both paths, which op a member holds open on a group and which
members never entered it; the NCCL recorder read live names the oldest open op (the training
thread waits elsewhere), and only a rank's oldest NCCL op waits on peers, as in dumps. No GPU
here: NCCL's records are fed in torch's documented format (tests/unit/test_engine.py)."""

from __future__ import annotations

import json
from typing import Any

from distdiag.hang.dumpreport import rank_dumps
from distdiag.hang.frontcore import Pos, completed_anywhere, entered, never_entered, open_seq
from distdiag.hang.frontier import attribute
from distdiag.hang.recorder import EngineReader, positions_from_dump
from distdiag.hang.views import build_views
from distdiag.hang.waitfor import build_graph, nodes_from_views
from tests.unit.test_engine import nccl_dump, nccl_entry


def test_positions_give_the_open_op_and_who_never_entered_it():
    ps = {0: Pos(7, 4), 1: Pos(5, 4), 2: Pos(4, 4), 3: Pos(None, None)}
    assert [open_seq(ps[r]) for r in range(4)] == [5, 5, None, None]
    assert open_seq(ps[0], floor=5) == 6 and open_seq(Pos(3, -1)) == 0
    assert entered(ps[1], 5) and not entered(ps[2], 5) and not entered(None, 1)
    assert never_entered(range(4), ps, 5) == [2, 3]
    assert never_entered(range(4), ps, 5, lost={1}) == [1, 2, 3]
    assert completed_anywhere({"g": ps, "h": {0: Pos(None, None)}}) == {"g": 4, "h": -1}


def test_nccl_live_view_names_the_oldest_open_op_not_the_last_enqueued():
    """NCCL queued #5-#7 behind each other and completed #4: the rank is inside #5 (the training
    thread waits at a later synchronisation, not in the call)."""
    entries = [nccl_entry(5, "scheduled", sizes=((8,),)), nccl_entry(6, "scheduled"), nccl_entry(7, "scheduled")]
    nccl = {"pg_status": {"0": {"last_enqueued_collective": 7, "last_completed_collective": 4}}, "entries": entries}
    view = EngineReader(dumpers=[("nccl", lambda a, b: json.dumps(nccl))]).read()
    (g,) = view["groups"]
    assert (g["enqueued"], g["completed"], g["pending"]["seq"], g["pending"]["shape"]) == (7, 4, 5, [8])


def test_gloo_live_view_keeps_the_last_enqueued():
    gloo = {"pg_status": {"0": {"last_enqueued_collective": "7", "last_completed_collective": "4"}},
            "entries": [nccl_entry(s, "scheduled") for s in (5, 6, 7)]}
    (g,) = EngineReader(dumpers=[("fr", lambda a, b: json.dumps(gloo))]).read()["groups"]
    assert g["pending"]["seq"] == 7


def _group(label: str, backend: str, enq: int, done: int, for_s: float) -> dict[str, Any]:
    pending = {"seq": done + 1, "op": "all_reduce", "shape": [4], "dtype": "float32", "for_s": for_s} if enq > done else None
    return {"group": label, "backend": backend, "enqueued": enq, "completed": done, "started": None, "pending": pending}


def _graph(backend: str):
    """Rank 0 is inside all_reduce #5 on ranks[0,1] (older) and #3 on ranks[0,2]; rank 1 never
    entered #5, rank 2 never entered #3."""
    engines = {
        0: [_group("ranks[0,1]", backend, 5, 4, 30.0), _group("ranks[0,2]", backend, 3, 2, 10.0)],
        1: [_group("ranks[0,1]", backend, 4, 4, 0.0)],
        2: [_group("ranks[0,2]", backend, 2, 2, 0.0)],
    }
    snaps = {r: {"phase": "training", "stack": [], "recent": [], "engine": {"state": "ok", "groups": gs}}
             for r, gs in engines.items()}
    views = build_views(snaps, {})
    return build_graph(nodes_from_views(views, {}, {}, 3), 3)


def test_only_the_oldest_nccl_op_waits_on_peers():
    g = _graph("nccl")
    assert [(e.dst, e.wait.seq) for e in g.edges[0]] == [(1, 5)]
    assert g.culprits() == [1]


def test_on_gloo_each_group_waits_on_its_own():
    """gloo runs the ops of different groups on threads of their own: both waits count."""
    g = _graph("fr")
    assert sorted(e.dst for e in g.edges[0]) == [1, 2] and g.culprits() == [1, 2]


def test_live_and_dump_paths_blame_the_same_rank():
    """The same NCCL records, read as dumps (hang/frontier.py) and as live views (hang/waitfor.py):
    rank 1 never entered #12, the others wait in it."""
    history = [nccl_entry(s, "completed") for s in range(1, 12)]
    raw = {r: nccl_dump(12, 12, 11, [*history, nccl_entry(12, "started")]) for r in (0, 2)}
    raw[1] = nccl_dump(11, 11, 11, history)
    dumps, world, _ = rank_dumps(raw, 3)
    from_dumps = attribute(dumps, world)
    snaps = {r: {"phase": "training", "stack": [], "recent": [], "engine": positions_from_dump(d)} for r, d in raw.items()}
    live = build_graph(nodes_from_views(build_views(snaps, {}), {}, {}, 3), 3)
    assert from_dumps.culprits() == live.culprits() == [1]
    assert sorted(r for r, es in from_dumps.edges.items() if any(e.dst == 1 for e in es)) == [0, 2]
    assert sorted(r for r, es in live.edges.items() if any(e.dst == 1 for e in es)) == [0, 2]
