"""The check's end at scale (issue 21): the writer's collector pause, and what each rank reads
when it leaves (the rank table of the silent ranks only, never all N rows on every rank)."""

from __future__ import annotations

import gc
import threading

from distdiag.check.finish import collector_paused


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
