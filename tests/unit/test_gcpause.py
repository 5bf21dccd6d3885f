"""Python's collector held off while a writer builds a 16k-rank report (distdiag/runtime/gcpause.py,
issue 21): used by the hang writer and the check's writer alike."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from distdiag.runtime.gcpause import collector_paused


def test_collector_paused_nests_and_restores_what_it_found():
    """Off inside (nested, on two threads), back on after the last block; left off if it was off."""
    assert gc.isenabled()
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        with collector_paused():
            entered.set()
            release.wait(5)

    thread = threading.Thread(target=other)
    with collector_paused():
        assert not gc.isenabled()
        thread.start()
        assert entered.wait(5)
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread's block is still open
    release.set()
    thread.join(5)
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_collector_is_held_off_while_the_writer_works_and_restored_after():
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        assert not gc.isenabled()
        raise RuntimeError("the analysis failed")
    assert gc.isenabled()
    with collector_paused():
        kept = [[i] for i in range(5000)]
    # what the window made is aged, not left young (the next allocation would walk it) nor frozen
    assert gc.get_count()[0] < 100 and gc.get_freeze_count() == 0 and gc.is_tracked(kept[-1])
    gc.freeze()  # a job that froze its objects (before forking workers) keeps them frozen
    try:
        assert gc.get_freeze_count() > 0
        with collector_paused():
            kept.append({})
        # still frozen (an unfreeze would leave none); not "the same count": a frozen object
        # freed meanwhile by its refcount (another test's thread ending) leaves the permanent set
        assert gc.get_freeze_count() > 0 and gc.isenabled()
    finally:
        gc.unfreeze()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _garbage_cycle() -> weakref.ref[_Cycle]:
    return weakref.ref(_Cycle())  # unreachable at once, freed only by the collector


def test_a_pause_that_does_not_freeze_leaves_young_garbage_collectable():
    """The check's consolidating thread (distdiag/check/ahead.py) pauses beside rank 0's running
    probe: a cycle the probe dropped meanwhile is freed by the next young collection, not aged
    into the oldest generation (where a released model's cycles would wait for a full one)."""
    with collector_paused(freeze=False):
        dropped = _garbage_cycle()
    gc.collect(0)
    assert dropped() is None
    with collector_paused():  # the writer's own pause ages what is alive then, garbage included
        aged = _garbage_cycle()
    gc.collect(0)
    assert aged() is not None
    gc.collect()
    assert aged() is None


def test_a_span_freezes_when_any_of_its_blocks_asked():
    with collector_paused(freeze=False):
        with collector_paused():
            aged = _garbage_cycle()
    gc.collect(0)
    assert aged() is not None
    gc.collect()
