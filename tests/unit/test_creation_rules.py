"""group_creation on the group logs the watchdog posts (distdiag.watchdog.groupnames): which side
of a group number bound to different members is named, and how sure it says it is. The logs of
real runs are in tests/faults/test_multigroup_hangs.py; these pin the decisions the runs cannot
make happen on demand (a two-against-two tie)."""

from __future__ import annotations

from types import SimpleNamespace

from distdiag.hang.creation_rules import group_creation


def _a(logs: dict[int, list[tuple[str, str, str]]], creating: tuple[int, ...] = (),
       waits: dict[int, str] | None = None) -> SimpleNamespace:
    views = {r: SimpleNamespace(snap={"groups_created": {"count": len(rows) + 1, "names": [list(x) for x in rows], "from": "calls"},
                                      "stack": ["x.py:1 in <module>", "c10d.py:9 in new_group"] if r in creating else []},
                                waits=[{"group": (waits or {})[r]}] if r in (waits or {}) else [])
             for r, rows in logs.items()}
    return SimpleNamespace(views=views, explained=set(), causes=set(), findings=[], world=len(logs))


def test_two_against_two_with_no_later_evidence_names_both_sides_at_half_with_their_lines():
    a = _a({0: [("1", "0,1", "t.py:28 in <module>")], 1: [("1", "0,1", "t.py:28 in <module>")],
            2: [("1", "2,3", "t.py:33 in <module>")], 3: [("1", "2,3", "t.py:33 in <module>")]}, creating=(0, 1, 2, 3))
    group_creation(a)
    (f,) = a.findings
    assert f.ranks == [0, 1, 2, 3] and f.confidence == 0.5 and f.cause == "desync"
    assert "ranks 0-1 made it at t.py:28" in f.issue and "ranks 2-3 made it at t.py:33" in f.issue, f.issue
    assert "not told by the ranks" in f.issue


def test_the_side_that_left_out_a_group_it_is_not_a_member_of_is_named_however_many():
    # 6 ranks: [0,1] made by its members only; ranks 2-5 (the majority) skipped it
    logs = {r: [("1", "0,1", "t.py:5"), ("2", "0+1x6", "t.py:6")] for r in (0, 1)}
    logs |= {r: [("1", "0+1x6", "t.py:6")] for r in (2, 3, 4, 5)}
    a = _a(logs)
    group_creation(a)
    (f,) = a.findings
    assert f.ranks == [2, 3, 4, 5] and f.confidence == 0.85 and "left out [0,1]" in f.issue, f.issue


def test_another_order_is_the_minority_and_no_conflict_says_nothing():
    order = [("1", "0,1,2", "t.py:7"), ("2", "1,2,3", "t.py:7")]
    a = _a({0: order, 1: order, 2: order, 3: [("1", "1,2,3", "t.py:9"), ("2", "0,1,2", "t.py:9")]})
    group_creation(a)
    (f,) = a.findings
    assert f.ranks == [3] and f.confidence == 0.8 and "another order" in f.issue, f.issue
    quiet = _a({0: order, 1: order[:1]})  # rank 1 merely behind in making groups: no conflict
    group_creation(quiet)
    assert quiet.findings == []


def test_a_conflict_no_wait_touches_is_a_warning_beside_the_hang_not_its_cause():
    # rank 3 made two groups in another order; every rank now waits on the default group
    # (another rank stalls elsewhere): the conflict is reported, but it is not why they wait
    order = [("1", "0,1,2", "t.py:7"), ("2", "1,2,3", "t.py:7")]
    logs = {0: order, 1: order, 2: order, 3: [("1", "1,2,3", "t.py:9"), ("2", "0,1,2", "t.py:9")]}
    a = _a(logs, waits={0: "world", 1: "world", 2: "world"})
    group_creation(a)
    (f,) = a.findings
    assert f.severity == "warning" and f.ranks == [3] and f.confidence <= 0.6, f
    assert "not why the ranks wait now" in f.evidence
    assert a.explained == set() and a.causes == set()
    # the same conflict with a rank waiting on one of the groups made at its number: the cause
    b = _a(logs, waits={0: "world", 1: "ranks[1,2,3]", 2: "world"})
    group_creation(b)
    (g,) = b.findings
    assert g.severity == "critical" and g.ranks == [3] and g.confidence == 0.8 and b.explained == {0, 1, 2, 3}
    # a wait on a group whose members are not known may be on it: the cause too
    c = _a(logs, waits={0: "group 5"})
    group_creation(c)
    assert c.findings[0].severity == "critical"
