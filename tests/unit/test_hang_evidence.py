"""The evidence that tells causes apart, each rule against its alternative: a DataLoader that ran
out (uneven data) versus a rank that left its loop with its data intact (a branch), a line only
one side of a two-rank desync ever issued, one error raised on every rank. The DataLoader tap
runs on torch's real DataLoader; the rules on snapshots shaped as the watchdog posts them."""

from __future__ import annotations

import pytest
import torch

from distdiag.hang import analyze_hang
from distdiag.watchdog.dataload import LoaderTap


def coll(op, seq, site="train.py:10", shape=(4,), group="world"):
    return {"op": op, "seq": seq, "group": group, "call_site": site, "shape": list(shape), "dtype": "float32",
            "for_s": 12.0, "index_in_probe": seq}


def snap(in_collective=None, steps=5, in_loop=True, loaders=None, history=None, stack=None):
    return {"phase": "training", "where": "step 5", "phase_for_s": 12.0, "step": steps,
            "steps": steps, "step_source": "optimizer", "in_loop": in_loop, "in_collective": in_collective,
            "stack": stack or ["/x/train.py:5 in main: loss.backward()"], "recent": [], "history": history or [],
            "loaders": loaders or [], "collectives_in_probe": 0}


def passes(drawn, exhausted, pass_=1, loader=0):
    return [{"loader": loader, "label": "RankStream", "pass": pass_, "drawn": drawn, "exhausted": exhausted}]


def run(snaps, errors=None):
    return analyze_hang(snaps, {}, errors or {}, len(snaps), what="training", timeout_s=10)


def lead(findings):
    return next(f for f in findings if f.severity in ("critical", "error"))


def test_the_loader_tap_counts_each_pass_and_sees_it_run_out():
    """torch's DataLoader, single process and with a persistent worker: a pass per epoch, its
    batches, StopIteration seen; an iterator begun before the tap is counted whole."""
    early = torch.utils.data.DataLoader(list(range(10)), batch_size=4)
    it = iter(early)
    next(it)
    tap = LoaderTap(lambda: 3)
    assert tap.install()
    try:
        list(it)
        list(early)
        worker = torch.utils.data.DataLoader(list(range(6)), batch_size=2, num_workers=1, persistent_workers=True)
        for _ in range(2):
            list(worker)
        partial = iter(early)
        next(partial)
    finally:
        tap.remove()
    got = [(p["loader"], p["pass"], p["drawn"], p["exhausted"]) for p in tap.snapshot()]
    assert got == [(0, 1, 3, True), (0, 2, 3, True), (1, 1, 3, True), (1, 2, 3, True), (0, 3, 1, False)], got
    assert all(p.get("at_steps") == 3 for p in tap.snapshot() if p["exhausted"])
    assert torch.utils.data.dataloader._BaseDataLoaderIter.__next__.__name__ == "__next__"
    assert not hasattr(torch.utils.data.dataloader._BaseDataLoaderIter.__next__, "__distdiag_loader_tap__")


def test_a_rank_whose_loader_ran_out_first_is_uneven_data_whatever_it_waits_in():
    """Rank 2's pass ended after 25 batches while its peers drew 26-27 and go on (a prefetching
    trainer: every rank took 24 steps). Rank 0 sits in a broadcast the recorder shows done, rank
    2 in a metric barrier: rank 2 is named, uneven data, and no peer is blamed beside it."""
    snaps = {r: snap(coll("all_reduce", 71, site="module.py:1137"), steps=24, loaders=passes(27, False)) for r in (1, 3)}
    snaps[0] = snap(None, steps=24, loaders=passes(26, False),
                    stack=["/x/loops/training_epoch_loop.py:265 in _broadcast_sigterm_tensor: broadcast(t, src=0)"])
    snaps[2] = snap(coll("barrier", 70, site="distributed.py:213", shape=()), steps=24, in_loop=False,
                    loaders=passes(25, True))
    findings = run(snaps)
    f = lead(findings)
    assert f.ranks == [2] and f.cause == "uneven_data" and f.confidence >= 0.9, f
    assert "ended after 25 batch(es)" in f.issue and "up to 27 in the same pass" in f.issue
    assert [g for g in findings if g.severity in ("critical", "error") and g is not f] == []


def test_a_pass_every_rank_finished_unevenly_is_not_what_they_wait_on():
    """The twin: rank 1's validation pass ended after fewer batches, but every rank has finished
    that pass; the ranks now wait on rank 1, which computes elsewhere: not uneven data."""
    val = [{"loader": 1, "label": "Val", "pass": 1, "drawn": 3, "exhausted": True}]
    snaps = {0: snap(coll("all_reduce", 9), loaders=passes(10, False) + [{**val[0], "drawn": 4}])}
    snaps[1] = snap(None, loaders=passes(10, False) + val)
    f = lead(run(snaps))
    assert f.ranks == [1] and f.cause != "uneven_data", f


def test_a_rank_that_left_its_loop_with_its_data_intact_is_not_uneven_data():
    """Rank 0 alone saves (an all_gather in a branch only it takes) after the same steps, its
    DataLoader not ended: the cause is not uneven data, and rank 0 leads."""
    snaps = {0: snap(coll("all_gather", 40, site="train.py:88 in save"), steps=10, in_loop=False,
                     loaders=passes(10, True)),
             1: snap(coll("all_reduce", 40, site="train.py:60 in step"), steps=10, loaders=passes(10, True))}
    f = lead(run(snaps))
    assert f.cause != "uneven_data" and 0 in f.ranks, f


def test_without_a_loader_leaving_the_loop_at_the_same_step_says_what_is_not_observed():
    """No DataLoader seen (a loop over a plain list), the same step count, out of the loop: likely
    uneven data (the list ran out), at a lower confidence, the fix naming the branch it could be."""
    snaps = {0: snap(None, steps=10, in_loop=False, stack=["/x/train.py:88 in save: torch.save(m)"]),
             1: snap(coll("all_reduce", 40), steps=10)}
    f = lead(run(snaps))
    assert f.ranks == [0] and f.confidence <= 0.7 and "no DataLoader was seen" in f.fix, f


def test_peers_that_compute_their_longer_share_are_not_waiting_on_the_short_rank():
    """An uneven evaluation pass without per-batch collectives is legitimate: ranks 0 and 2 ended
    theirs and wait in the final gather while rank 1 still computes its longer share and is
    stuck there: rank 1 is named, not the ranks whose data ended."""
    ev = lambda drawn, ended: [{"loader": 0, "label": "Eval", "pass": 1, "drawn": drawn, "exhausted": ended}]  # noqa: E731
    snaps = {r: snap(coll("all_gather", 30), loaders=ev(10, True)) for r in (0, 2)}
    snaps[1] = snap(None, loaders=ev(12, False), stack=["/x/eval.py:40 in predict: model(x)"])
    f = lead(run(snaps))
    assert f.ranks == [1] and f.cause != "uneven_data", f


def test_a_rank_that_went_on_to_its_loaders_next_pass_did_not_run_out():
    """A step-driven loop re-iterates its DataLoader when a pass ends (shards of other lengths are
    healthy there): rank 0's pass 1 ended at 25 and it draws from pass 2; rank 1 stalls computing:
    rank 1 is named, not rank 0."""
    snaps = {0: snap(coll("all_reduce", 60), loaders=passes(25, True) + passes(6, False, pass_=2))}
    snaps[1] = snap(None, loaders=passes(31, False), stack=["/x/train.py:50 in step: model(x)"])
    f = lead(run(snaps))
    assert f.ranks == [1] and f.cause != "uneven_data", f


def test_malformed_loader_records_are_left_out_never_raised_on():
    """Another version's or a corrupt value: not a list, a string where a number goes."""
    snaps = {0: {**snap(coll("all_reduce", 9)), "loaders": 5},
             1: snap(None, loaders=[{"loader": 0, "pass": 1, "drawn": 3, "last": "7a", "len": "40", "label": None},
                                    {"loader": "x"}, 7])}
    f = lead(run(snaps))
    assert f.ranks == [1], f


def test_two_rank_desync_names_the_side_whose_line_the_other_never_issued():
    """Rank 0 issued an all_reduce from a callback line rank 1 never ran; rank 1's all_gather
    comes from a line rank 0 ran before (a logging gather): rank 0 is the odd one."""
    shared = [coll("all_gather", 20, site="trainer_pt_utils.py:207"), coll("all_reduce", 21, site="accelerator.py:2861")]
    snaps = {0: snap(coll("all_reduce", 46, site="hf_train.py:92 in on_step_end"), history=list(shared)),
             1: snap(coll("all_gather", 46, site="trainer_pt_utils.py:207"), history=list(shared))}
    f = lead(run(snaps))
    assert f.ranks == [0] and f.cause == "desync" and "not in its peers' recorded history" in f.issue, f


def test_two_rank_desync_stays_undecided_when_both_lines_are_known():
    """The twin: both lines were issued by both ranks before: no side is named alone."""
    shared = [coll("all_reduce", 20, site="a.py:1"), coll("all_gather", 21, site="b.py:2")]
    snaps = {0: snap(coll("all_reduce", 46, site="a.py:1"), history=list(shared)),
             1: snap(coll("all_gather", 46, site="b.py:2"), history=list(shared))}
    f = lead(run(snaps))
    assert f.ranks == [0, 1], f


def test_one_error_raised_on_every_rank_is_one_finding_naming_them_all():
    """The same ValueError at the same line, its message naming each rank: one finding, both ranks."""
    snaps = {0: snap(None), 1: snap(None)}
    errors = {r: {"type": "ValueError", "message": f"bad batch at step 5 on rank {r}", "raised_at": "train.py:14",
                  "traceback": "Traceback..."} for r in (0, 1)}
    f = lead(run(snaps, errors))
    assert f.ranks == [0, 1] and f.cause == "raised", f


def test_a_pass_drawn_to_its_planned_length_ended_without_a_stopiteration():
    """The HF Trainer plans its steps from len(loader) and never asks past the end: rank 1 drew
    all 5 batches of its pass and finished while rank 0's pass of 10 goes on: uneven data."""
    snaps = {0: snap(coll("all_reduce", 30), steps=6, loaders=[{**passes(6, False)[0], "len": 10}]),
             1: {**snap(None, steps=5, in_loop=False, loaders=[{**passes(5, False)[0], "len": 5}]), "phase": "barrier"}}
    f = lead(run(snaps))
    assert f.ranks == [1] and f.cause == "uneven_data", f


def test_a_skipped_fsdp_unit_is_named_from_one_earlier_step_in_view():
    """FSDP issues every all-gather and reduce-scatter from the model's call: one line, many ops.
    The recorder's tail holds one whole earlier step. Rank 1's step skips an all-gather (a
    layer left out by a data-dependent branch) and reaches the reduce-scatter at #11 where rank 0
    is in the all-gather: rank 1 departs from its own step, rank 0 does not."""
    def hist(step_ops):
        recs, seq = [], 0
        for step, ops in enumerate(step_ops):
            for op in ops:
                seq += 1
                recs.append({**coll(op, seq, site="train.py:91 in <module>"), "step": step})
        return recs
    full = ["all_gather"] * 3 + ["reduce_scatter"] * 2
    h0, h1 = hist([full[2:], full, ["all_gather"] * 3]), hist([full[2:], full, ["all_gather"] * 2])
    snaps = {0: snap(h0[-1], history=h0[:-1]), 1: snap({**coll("reduce_scatter", 11, site="train.py:91 in <module>"),
                                                         "step": 2}, history=h1)}
    f = lead(run(snaps))
    assert f.ranks == [1] and f.cause == "desync", f


def test_a_pass_a_peer_has_left_for_another_is_not_what_it_waits_on():
    """Rank 1's validation pass was shorter and rank 0 drew its last validation batch (no
    StopIteration asked: a planned length) but went back to training since: not uneven data."""
    val0 = {"loader": 1, "label": "Val", "pass": 1, "drawn": 4, "exhausted": False, "len": 4, "last": 5}
    train0 = {**passes(12, False)[0], "last": 9}
    val1 = {**val0, "drawn": 3, "len": 3, "last": 4}
    snaps = {0: snap(coll("all_reduce", 9), loaders=[train0, val0]),
             1: snap(None, loaders=[{**train0, "drawn": 11, "last": 8}, val1])}
    f = lead(run(snaps))
    assert f.ranks == [1] and f.cause != "uneven_data", f


def test_the_tap_follows_loaders_built_anew_and_keeps_no_data_alive():
    """A DataLoader built each epoch (12 of them): the latest is still followed, the oldest are
    forgotten, and a dropped loader's data is freed (the tap holds its sampler weakly)."""
    import gc
    import weakref

    tap = LoaderTap()
    assert tap.install()
    try:
        for epoch in range(12):
            list(torch.utils.data.DataLoader(list(range(4 + epoch)), batch_size=2))
        data = torch.utils.data.TensorDataset(torch.zeros(6, 2))
        ref = weakref.ref(data)
        list(torch.utils.data.DataLoader(data, batch_size=3))
        del data
        gc.collect()
    finally:
        tap.remove()
    loaders = {p["loader"] for p in tap.snapshot()}
    assert 12 in loaders and 0 not in loaders and len(loaders) <= 8, loaders  # dropped loaders forgotten
    assert ref() is None


@pytest.mark.parametrize(("world", "short"), [(3, 1), (16, 7), (16, 0)])
def test_the_short_rank_alone_is_named_at_other_world_sizes(world, short):
    """Not a power of two, and 16 ranks: the rank whose pass ended is named, every other rank is
    stranded (none in a critical finding), whatever rank is short."""
    snaps = {r: snap(coll("all_reduce", 40, site="module.py:1137"), loaders=passes(26, False)) for r in range(world)}
    snaps[short] = snap(coll("barrier", 39, site="distributed.py:213", shape=()), in_loop=False, loaders=passes(25, True))
    findings = run(snaps)
    critical = [f for f in findings if f.severity in ("critical", "error")]
    assert [f.ranks for f in critical] == [[short]] and critical[0].cause == "uneven_data", critical


@pytest.mark.parametrize("world", [3, 16])
def test_every_rank_with_its_whole_pass_is_no_uneven_data(world):
    """The twin at those sizes: every pass drawn alike, one rank computing elsewhere: it is named,
    and the cause is not uneven data."""
    snaps = {r: snap(coll("all_reduce", 40), loaders=passes(26, False)) for r in range(world)}
    snaps[world - 1] = snap(None, loaders=passes(26, False), stack=["/x/train.py:50 in step: model(x)"])
    f = lead(run(snaps))
    assert f.ranks == [world - 1] and f.cause != "uneven_data", f
