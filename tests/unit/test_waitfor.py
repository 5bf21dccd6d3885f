"""The wait-for graph (distdiag.hang.waitfor) on its own input type: chains, ends, cycles.

The real runs that feed it are in tests/faults/test_multigroup_hangs.py; here each shape of
graph is built directly from `Node`s (the interface live snapshots and dumps both fill).
"""

from __future__ import annotations

from distdiag.hang.desync import departure
from distdiag.hang.waitfor import Node, Wait, build_graph


def ar(group, seq, op="all_reduce"):
    label = f"{op} #{seq} on ranks[{','.join(map(str, group))}]"
    return Wait(tuple(group), seq, label, (op, "[8]", "float32"))


def waiting(rank, *waits, enq=None):
    return Node(rank, "waiting", list(waits), enq)


def test_mesh_chain_ends_at_the_stalled_rank_and_strands_the_others():
    """2x2 mesh: 3 stalled; 2 waits in TP [2,3], 0 in DP [0,2] for 2, 1 in DP [1,3] for 3."""
    nodes = {
        0: waiting(0, ar((0, 2), 3), enq={(0, 2): 3, (0, 1): 3}),
        1: waiting(1, ar((1, 3), 3), enq={(1, 3): 3, (0, 1): 3}),
        2: waiting(2, ar((2, 3), 3), enq={(0, 2): 2, (2, 3): 3}),
        3: Node(3, "computing", enqueued={(1, 3): 2, (2, 3): 2}, where="data.py:7 in load_next_microbatch"),
    }
    g = build_graph(nodes, 4)
    assert g.culprits() == [3] and sorted(g.stranded) == [0, 1, 2]
    assert g.chains([0]) == ["rank 0 waits for 2 in all_reduce #3 on ranks[0,2]; rank 2 waits for 3 in all_reduce #3 "
                             "on ranks[2,3]; rank 3 is at data.py:7 in load_next_microbatch"]


def test_recv_waits_for_its_peer():
    nodes = {0: waiting(0, Wait((0, 1), -1, "recv from rank 1", peer=1)), 1: Node(1, "computing", where="loss.py:3")}
    g = build_graph(nodes, 2)
    assert g.culprits() == [1] and g.stranded[0][0].dst == 1


def test_matching_send_and_recv_inside_are_not_blockers():
    nodes = {0: waiting(0, Wait((0, 1), -1, "recv from rank 1", ("recv",), peer=1)),
             1: waiting(1, Wait((0, 1), -1, "send to rank 0", ("send",), peer=0))}
    g = build_graph(nodes, 2)
    assert g.culprits() == [] and not g.stranded


def test_two_ranks_each_in_a_recv_from_the_other_are_a_deadlock():
    nodes = {0: waiting(0, Wait((0, 1), -1, "recv from rank 1", ("recv",), peer=1)),
             1: waiting(1, Wait((0, 1), -1, "recv from rank 0", ("recv",), peer=0))}
    g = build_graph(nodes, 2)
    assert [e.kind for e in g.ends] == ["deadlock"] and g.culprits() == [0, 1]


def test_opposite_order_is_a_cycle():
    nodes = {
        0: waiting(0, ar((0, 2), 3), enq={(0, 1): 2, (0, 2): 3}),
        1: waiting(1, ar((0, 1), 3), enq={(0, 1): 3, (1, 2): 2}),
        2: waiting(2, ar((1, 2), 3), enq={(1, 2): 3, (0, 2): 2}),
        3: waiting(3, ar((2, 3), 1), enq={(2, 3): 1}),
    }
    g = build_graph(nodes, 4)
    (end,) = g.ends
    assert end.kind == "deadlock" and end.ranks == [0, 1, 2] and len(end.cycle) == 3
    assert g.stranded[3][0].dst == 2 and g.end_of[3] is end


def test_every_member_inside_and_none_completed_is_a_stall_not_a_culprit():
    nodes = {0: waiting(0, ar((0, 1), 5), enq={(0, 1): 5}), 1: waiting(1, ar((0, 1), 5), enq={(0, 1): 5}),
             2: waiting(2, ar((0, 2), 2), enq={(0, 2): 2})}
    g = build_graph(nodes, 3)
    kinds = sorted(e.kind for e in g.ends)
    assert kinds == ["stall"] and g.culprits() == [] and g.end_of[2].kind == "stall"


def test_different_ops_at_the_same_number_are_left_to_the_desync_rules():
    nodes = {0: waiting(0, ar((0, 1), 5), enq={(0, 1): 5}), 1: waiting(1, ar((0, 1), 5, "all_gather"), enq={(0, 1): 5})}
    g = build_graph(nodes, 2)
    assert [e.kind for e in g.ends] == ["mismatch"] and g.culprits() == []


def test_a_lost_member_ends_the_chain():
    nodes = {0: waiting(0, ar((0, 1, 2), 4)), 1: Node(1, "lost", where="(its process is gone)"), 2: waiting(2, ar((0, 1, 2), 4))}
    g = build_graph(nodes, 3)
    assert g.culprits() == [1]


def test_thousands_of_ranks_in_one_chain():
    """A pipeline of 4096 ranks, each waiting for the next: the end is the last one."""
    n = 4096
    nodes = {r: waiting(r, ar((r, r + 1), 1), enq={(r, r + 1): 1, (r - 1, r): 0}) for r in range(n - 1)}
    nodes[n - 1] = Node(n - 1, "computing", where="x.py:1")
    g = build_graph(nodes, n)
    assert g.culprits() == [n - 1] and len(g.stranded[0]) == n - 1


def _hist(sites_per_step, current=None, in_loop=True):
    recs, seq = [], 0
    for step, sites in enumerate(sites_per_step):
        for site in sites:
            seq += 1
            recs.append({"op": "all_reduce", "group": "world", "seq": seq, "call_site": site, "step": step})
    return {"history": recs, "in_collective": current, "in_loop": in_loop}


def test_departure_names_the_position_where_a_step_changed_course():
    mine = _hist([["a", "b", "c"]] * 4 + [["a", "x"]])
    assert "collective 2 of the step came from all_reduce at x" in departure(mine) and "from all_reduce at b" in departure(mine)
    assert departure(_hist([["a", "b", "c"]] * 4 + [["a", "b"]])) is None
    assert "left its training loop" in departure(_hist([["a"]] * 4, in_loop=False))


def test_the_users_line_is_shown_beside_a_library_frame():
    """A rank waiting in accelerate's wait_for_everyone: the job's own line that called it is shown."""
    from distdiag.hang.views import where, with_user_site

    lib = "/usr/lib/python3.11/site-packages/accelerate/state.py:412 in wait_for_everyone: torch.distributed.barrier()"
    stack = ["/job/train.py:80 in main: fit()", "/job/train.py:41 in fit: state.wait_for_everyone()", lib]
    assert with_user_site(lib, stack) == f"/job/train.py:41 in fit: state.wait_for_everyone() (through {lib})"
    assert where(stack) == f"{lib} (called from /job/train.py:41 in fit: state.wait_for_everyone())"
    assert where(stack[:2]) == stack[1]


def test_positions_from_a_dump_reader_feed_the_same_graph():
    """Per-rank, per-group positions (keyed by members), as a dump reader gives them."""
    from distdiag.hang.waitfor import nodes_from_positions

    ar = {"op": "all_reduce", "sizes": [[8, 8]], "dtypes": ["Float"]}
    per_rank = {
        0: {(0, 2): {**ar, "seq": 3, "completed": 2}, (0, 1): {**ar, "seq": 3, "completed": 3}},
        1: {(1, 3): {**ar, "seq": 3, "completed": 2}, (0, 1): {**ar, "seq": 3, "completed": 3}},
        2: {(0, 2): {**ar, "seq": 2, "completed": 2}, (2, 3): {**ar, "seq": 3, "completed": 2}},
        3: {(1, 3): {**ar, "seq": 2, "completed": 2}, (2, 3): {**ar, "seq": 2, "completed": 2}},
    }
    g = build_graph(nodes_from_positions(per_rank, 4), 4)
    assert g.culprits() == [3] and sorted(g.stranded) == [0, 1, 2]
    assert g.chains([0])[0].startswith("rank 0 waits for 2 in all_reduce #3 on ranks[0,2]")


# -- hubs: a collective many members never entered (N^2/4 edges without them) -----------------


def _graph_summary(g):
    return (g.culprits(), sorted(g.stranded), g.chains(sorted(g.stranded)), [(e.kind, e.ranks) for e in g.ends])


def _both_ways(monkeypatch, nodes, world):
    import distdiag.hang.waitfor as waitfor

    with_hubs = build_graph(nodes, world)
    monkeypatch.setattr(waitfor, "HUB_MIN", 10**9)
    direct = build_graph(nodes, world)
    monkeypatch.undo()
    return with_hubs, direct


def test_half_the_world_never_entered_costs_edges_linear_in_ranks(monkeypatch):
    """1024 ranks: the first half waits in a world all-reduce the second half (computing)
    never entered. One hub instead of 512 x 512 edges, and the same verdict."""
    world = 1024
    group = tuple(range(world))
    nodes = {r: waiting(r, ar(group, 7), enq={group: 7}) for r in range(world // 2)}
    nodes.update({r: Node(r, "computing", enqueued={group: 6}, where="eval.py:3 in evaluate") for r in range(world // 2, world)})
    g, direct = _both_ways(monkeypatch, nodes, world)
    assert sum(len(es) for es in g.edges.values()) <= 2 * world
    assert sum(len(es) for es in direct.edges.values()) == (world // 2) ** 2
    assert _graph_summary(g) == _graph_summary(direct)
    assert g.culprits() == list(range(world // 2, world))
    assert sorted(e.src for e in g.into(world - 1)) == list(range(world // 2))
    assert {e.dst for e in g.direct(0)} == set(range(world // 2, world))


def test_a_deadlock_through_two_hubs_is_named_with_ranks_only(monkeypatch):
    """Ranks 0-19 wait in A #5 that 20-39 never entered; 20-40 wait in B #5 that 0-19 never
    entered (opposite order, 20 missing on each side: both through hubs); rank 40 is stranded."""
    a, b = tuple(range(40)), tuple(range(41))
    nodes = {r: waiting(r, ar(a, 5), enq={a: 5, b: 4}) for r in range(20)}
    nodes.update({r: waiting(r, ar(b, 5), enq={a: 4, b: 5}) for r in range(20, 41)})
    g, direct = _both_ways(monkeypatch, nodes, 41)
    assert _graph_summary(g)[:2] == _graph_summary(direct)[:2]
    assert [(e.kind, e.ranks) for e in g.ends] == [("deadlock", list(range(40)))]
    cycle = g.ends[0].cycle
    assert cycle and all(e.src >= 0 and e.dst >= 0 for e in cycle)
    assert all(x.dst == y.src for x, y in zip(cycle, cycle[1:] + cycle[:1], strict=True))
    assert sorted(g.stranded) == [40] and all(e.dst >= 0 for e in g.stranded[40])
