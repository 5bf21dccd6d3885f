"""Culprit rules of distdiag.hang on hand-made snapshots (the dist tests prove them for real)."""

from __future__ import annotations

import pytest

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


def test_one_rank_stranded_in_a_barrier_reads_as_one_rank_in_a_barrier():
    """'rank 0 was left waiting in barrier #1 on world', not 'rank 0 were left waiting in
    barrier #1 on world (none[-])' (a barrier has no tensor: the tracker's dtype 'none')."""
    barrier = {**coll("barrier", 1, shape=()), "dtype": "none"}
    snaps = {0: snap(in_collective=barrier), 1: snap(phase="barrier")}
    errors = {1: {"type": "RuntimeError", "message": "boom", "traceback": "Traceback..."}}
    (f,) = run(snaps, errors=errors)
    assert "; rank 0 was left waiting in barrier #1 on world that it never entered" in f.issue, f.issue


def test_slow_step_without_collectives():
    snaps = {0: snap(), 1: snap()}
    (f,) = run(snaps)
    assert "did not finish within 5s" in f.issue and "--timeout-s" in f.fix


# -- engine views (torch's flight recorder in each snapshot) ----------------------------------


def engine(*groups):
    """An engine view: groups as (label, enqueued, completed[, op])."""
    out = []
    for label, enq, done, *op in groups:
        g = {"pg": "0", "group": label, "backend": "fr", "enqueued": enq, "started": None, "completed": done, "pending": None}
        if enq > done:
            g["pending"] = {"seq": enq, "op": op[0] if op else "all_reduce", "shape": [9], "dtype": "float", "for_s": 4.0}
        out.append(g)
    return {"state": "ok", "groups": out}


def esnap(eng, stack=None, steps=None, in_loop=None, source="optimizer", phase="training"):
    return {"phase": phase, "where": "step", "phase_for_s": 4.0, "in_collective": None,
            "stack": stack or ["/x/train.py:40 in loop: loss.backward()", "/site-packages/torch/autograd/graph.py:8 in _engine_run_backward: x"],
            "recent": [], "engine": eng, "steps": steps, "step_source": source, "in_loop": in_loop, "loop": "/x/train.py in loop"}


def test_engine_position_names_the_rank_that_never_entered_even_without_wrappers():
    """DDP's all-reduce: no wrapper saw it, the recorder did; rank 2 is behind on world."""
    snaps = {0: esnap(engine(("world", 9, 8))), 1: esnap(engine(("world", 9, 8))),
             2: esnap(engine(("world", 8, 8)), stack=["/x/train.py:33 in loop: batch = next(it)"], steps=3, in_loop=True)}
    for r in (0, 1):
        snaps[r]["steps"] = 3
    (f,) = run(snaps)
    assert f.ranks == [2] and "never entered all_reduce #9 on world that ranks 0-1 wait in" in f.issue
    assert "via backward()" not in f.issue and "train.py:33" in f.issue and "after 3 optimizer step(s)" in f.issue


def test_a_rank_that_left_its_training_loop_is_uneven_data():
    snaps = {r: esnap(engine(("world", 9, 8)), steps=3, in_loop=True) for r in (0, 1)}
    snaps[2] = esnap(engine(("world", 8, 8)), stack=["/x/train.py:60 in main: save(model)"], steps=3, in_loop=False)
    (f,) = run(snaps)
    assert f.ranks == [2] and "left its training loop" in f.issue and "DistributedSampler" in f.fix and "Join" in f.fix


def test_fewer_marked_steps_is_a_lag():
    snaps = {r: esnap(engine(("world", 9, 8)), steps=5, source="marks") for r in (0, 1)}
    snaps[2] = esnap(engine(("world", 8, 8)), stack=["/x/train.py:60 in main: save(model)"], steps=4, source="marks")
    (f,) = run(snaps)
    assert f.ranks == [2] and "taken 4 training step(s) and the waiting ranks 5" in f.issue


def test_two_ranks_waiting_for_each_other_on_two_groups_are_a_deadlock():
    """Rank 1 waits in its pipeline group [1,2] for rank 2, which waits on world for rank 1: a
    cycle (the two ranks issue the groups in opposite orders); rank 0 waits on them in turn."""
    snaps = {0: esnap(engine(("world", 5, 4), ("ranks[1,2]", 3, 3))),
             1: esnap(engine(("world", 4, 4), ("ranks[1,2]", 4, 3, "broadcast"))),
             2: esnap(engine(("world", 5, 4), ("ranks[1,2]", 3, 3)))}
    findings = run(snaps)
    lead = findings[0]
    assert lead.ranks == [1, 2] and lead.issue.startswith("deadlock between groups"), lead.issue
    assert "rank 1 waits for 2 in broadcast #4 on ranks[1,2]" in lead.issue
    assert "rank 2 waits for 1 in all_reduce #5 on world" in lead.issue and "rank 0 wait" in lead.issue
    assert not any(0 in f.ranks for f in findings)


def test_a_caught_exception_leads_and_the_desync_it_causes_is_a_consequence():
    snaps = {0: esnap(engine(("world", 6, 5, "all_reduce"))), 1: esnap(engine(("world", 6, 5, "broadcast"))),
             2: esnap(engine(("world", 6, 5, "broadcast")))}
    errors = {0: {"type": "RuntimeError", "message": "Numpy is not available", "caught": True,
                  "through": "dcp.save -> ... -> gather_object", "raised_at": "c10d.py:9 in _tensor_to_object"}}
    findings = run(snaps, errors=errors)
    assert findings[0].ranks == [0] and findings[0].severity == "critical"
    assert "caught an exception on rank 0" in findings[0].issue and "dcp.save" in findings[0].issue
    assert "ranks 1-2 were left waiting in broadcast #6" in findings[0].issue and "numpy" in findings[0].fix
    desync = next(f for f in findings if "desync" in f.issue)
    assert desync.severity == "error" and "consequence" in desync.issue


def test_never_checked_in_gives_way_to_the_rank_that_died():
    from distdiag.hang.records import Silence, SilentReason

    findings = run({0: snap()}, lost={
        1: Silence(SilentReason.GONE, "its process (pid 9) is gone: killed or exited"),
        2: Silence(SilentReason.NEVER_CHECKED_IN, "it never checked in (no rank table entry): it was still starting"),
    }, world=3)
    by_rank = {f.ranks[0]: f for f in findings}
    assert by_rank[1].severity == "critical" and by_rank[2].severity == "warning"


def test_comm_errors_are_consequences_of_the_lost_rank():
    snaps = {0: snap(), 2: snap()}
    errors = {0: {"type": "RuntimeError", "message": "Connection closed by peer", "comm": True}}
    findings = run(snaps, lost={1: "its process (pid 9) is gone: killed or exited"}, errors=errors, world=3)
    assert findings[0].ranks == [1] and "Connection closed" not in findings[0].issue
    assert "consequence" in findings[0].evidence


def test_a_rank_that_left_while_the_others_went_on_is_named_after_their_collective_failed():
    """Lightning's uneven data: rank 1 finished and its process left; rank 0's all-reduce then
    failed with a broken connection, so nobody waits any more. The counts name rank 1."""
    snaps = {0: esnap(engine(("world", 12, 12)), stack=["/x/fit.py:9 in finish: close(error)"], steps=4),
             1: esnap(engine(("world", 11, 11)), stack=[], steps=3, phase="barrier")}
    errors = {0: {"type": "RuntimeError", "message": "Connection closed by peer [127.0.0.1]:1", "comm": True}}
    findings = run(snaps, errors=errors)
    assert findings[0].ranks == [1] and "finished" in findings[0].issue and "issued 11 collectives, the others 12" in findings[0].issue
    assert "lost their connection" in findings[0].issue and "DistributedSampler" in findings[0].fix


def test_the_check_s_own_entry_files_are_never_named_as_the_job_s_line():
    """A rank forked by `distdiag check` runs forked_rank.py as __main__ (`python -m distdiag.check`:
    __main__.py): when the check itself waits in torch, no frame is the job's line, and a probe's is."""
    from distdiag.hang.views import user_frame

    site = "/venv/lib/python3.11/site-packages"
    torch_wait = f"{site}/torch/distributed/distributed_c10d.py:4500 in barrier: work.wait()"
    run_py = f"{site}/distdiag/check/run.py:290 in execute: self.ex.barrier()"
    for entry in ("forked_rank.py:42 in <module>: main(sys.argv[1:], forked=True)", "__main__.py:5 in <module>: main()"):
        stack = ["/usr/lib/python3.11/runpy.py:88 in _run_code: exec(code)", f"{site}/distdiag/check/{entry}", run_py]
        assert user_frame([*stack, torch_wait]) is None
        probe = f"{site}/distdiag/probes/cluster/collectives.py:150 in reductions: comm.all_reduce(x)"
        assert user_frame([*stack, probe, torch_wait]) == probe


def test_a_stacks_reading_is_the_same_kept_or_not_and_odd_frames_are_still_read():
    """where / user_frame / issued_via are kept per distinct stack (the ranks of a job share a
    few): the kept answer is the uncached one, for the list and for a copy of it; a stack with
    an unhashable frame (a dict from an odd tracker) is read, not kept."""
    from distdiag.hang import views

    site = "/venv/lib/python3.11/site-packages"
    stack = ["train.py:88 in main: loss.backward()", f"{site}/torch/_tensor.py:521 in backward: torch.autograd.backward(",
             f"{site}/torch/distributed/distributed_c10d.py:2501 in all_reduce: work.wait()"]
    for reading, cached in ((views.where, views._where), (views.user_frame, views._user_frame),
                            (views.issued_via, views._issued_via)):
        plain = cached.__wrapped__(tuple(stack))
        assert reading(stack) == reading(list(stack)) == plain, reading.__name__
    assert views.user_frame(stack) == "train.py:88 in main: loss.backward()"
    odd = [{"frame": 1}, "train.py:9 in main: x()"]
    assert views.user_frame(odd) == "train.py:9 in main: x()"  # read through the fallback: tuple(odd) has no hash
    with pytest.raises(TypeError):
        hash(tuple(odd))


def test_nobody_waiting_does_not_contradict_a_table_that_shows_ranks_in_a_call():
    """Issue 24: every rank inside a wrapped call whose collectives the recorder has all completed:
    the table says 'collective', so the finding must not say 'no rank is inside a collective'."""
    snaps = {r: esnap(engine(("world", 9, 9))) for r in (0, 1)}
    for s in snaps.values():
        s["in_collective"] = coll("all_reduce", 4)
    findings = run(snaps)
    lead = findings[0]
    assert "no rank is inside a collective" not in lead.issue and "torch's recorder completed every one" in lead.issue


def test_ranks_in_recvs_from_different_peers_are_no_desync():
    """send/recv pair by peer: three ranks each in a recv from its own peer are not 'inside
    different collectives at the same sequence number'."""
    p2p = [{"op": f"recv(src={src})", "seq": 0, "group": "p2p", "call_site": "pp.py:9", "shape": [4], "dtype": "float32",
            "for_s": 5.0} for src in (1, 2, 3)]
    snaps = {r: snap(in_collective=p2p[r]) for r in range(3)}
    snaps[3] = snap()
    findings = run(snaps)
    assert not any("desync" in f.issue for f in findings), [f.issue for f in findings]
    assert findings[0].ranks == [3], [f.issue for f in findings]
    assert "rank 0 waits for 1 in recv from rank 1" in findings[-1].evidence
