"""Culprit rules of distdiag.hang on hand-made snapshots (the dist tests prove them for real)."""

from __future__ import annotations

from distdiag.hang import analyze_hang


def coll(op, seq, group="world", site="train.py:10", shape=(4,), for_s=5.0):
    return {"op": op, "seq": seq, "group": group, "call_site": site, "shape": list(shape), "dtype": "float32",
            "for_s": for_s, "index_in_probe": seq}


def snap(phase="probe", in_collective=None, stack=None, recent=None, n=0):
    return {"phase": phase, "probe": "p", "probe_index": 0, "phase_for_s": 6.0, "in_collective": in_collective,
            "stack": stack or ["/x/train.py:5 in step: time.sleep(60)"], "recent": recent or [],
            "collectives_in_probe": n}


def run(snaps, lost=None, errors=None, world=None):
    return analyze_hang(snaps, lost or {}, errors or {}, world or len(snaps) + len(lost or {}), what="probe 'p'", timeout_s=5)


def test_rank_outside_collective_is_named_with_its_line():
    """Ranks wait in all_reduce; the one computing elsewhere is the culprit, with its frame."""
    snaps = {0: snap(in_collective=coll("all_reduce", 3)), 1: snap(), 2: snap(in_collective=coll("all_reduce", 3))}
    (f,) = run(snaps)
    assert f.severity == "critical" and f.ranks == [1]
    assert "never entered all_reduce #3" in f.issue and "train.py:5" in f.issue


def test_lost_rank_is_the_cause():
    snaps = {0: snap(in_collective=coll("all_reduce", 3))}
    findings = run(snaps, lost={1: "its process (pid 9) is gone"})
    assert findings[0].ranks == [1] and "lost" in findings[0].issue


def test_finished_rank_issued_fewer_collectives():
    snaps = {0: snap(in_collective=coll("all_reduce", 4), n=4), 1: snap(phase="barrier", n=3)}
    (f,) = run(snaps)
    assert f.ranks == [1] and "issued fewer collectives" in f.issue


def test_desync_majority_names_the_odd_rank_and_first_divergence():
    """Three ranks in all_reduce #5, one in all_gather #5: the odd one is named."""
    history = [coll("all_reduce", 4, site="a.py:1")]
    snaps = {r: snap(in_collective=coll("all_reduce", 5, site="a.py:2"), recent=history) for r in (0, 1, 2)}
    snaps[3] = snap(in_collective=coll("all_gather", 5, site="b.py:9"), recent=history)
    (f,) = run(snaps)
    assert f.ranks == [3] and "desync" in f.issue
    assert "b.py:9" in f.evidence and "first divergence at world #5" in f.evidence


def test_desync_tie_names_both():
    snaps = {0: snap(in_collective=coll("broadcast(src=0)", 5)), 1: snap(in_collective=coll("broadcast(src=1)", 5))}
    (f,) = run(snaps)
    assert f.ranks == [0, 1] and "no majority" in f.issue and f.confidence < 0.8


def test_everyone_in_same_collective_is_a_stall():
    snaps = {r: snap(in_collective=coll("all_reduce", 7)) for r in range(3)}
    (f,) = run(snaps)
    assert "does not complete" in f.issue and f.ranks == []


def test_raise_that_strands_others_leads():
    snaps = {0: snap(in_collective=coll("all_reduce", 2)), 1: snap(phase="barrier")}
    errors = {1: {"type": "ValueError", "message": "bad shape", "traceback": "Traceback..."}}
    (f,) = run(snaps, errors=errors)
    assert f.severity == "critical" and f.ranks == [1]
    assert "ValueError: bad shape" in f.issue and "left waiting in all_reduce #2" in f.issue


def test_slow_step_without_collectives():
    snaps = {0: snap(), 1: snap()}
    (f,) = run(snaps)
    assert "did not finish within 5s" in f.issue and "--timeout-s" in f.fix
