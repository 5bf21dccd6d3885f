"""Tracker.timed and the sentinel's tick: quiet while a probe times a loop, not while it is stuck."""

from __future__ import annotations

import pytest

from distdiag.runtime import sentinel
from distdiag.runtime.tracker import Tracker


def test_timed_sets_the_flag_and_clears_it_even_on_error():
    tracker = Tracker()
    assert tracker.timing is False
    with tracker.timed():
        assert tracker.timing is True
    assert tracker.timing is False
    with pytest.raises(RuntimeError), tracker.timed():
        raise RuntimeError("a collective failed mid-loop")
    assert tracker.timing is False


def test_the_sentinel_ticks_slowly_only_for_the_first_seconds_of_a_timed_loop():
    """Outside a timed loop: TICK_S. Inside: TIMING_TICK_S (<= 1 s, so deadlines and peers'
    aborts are still seen within a second). A loop timed for longer than TIMING_QUIET_MAX_S
    is probably hung: back to TICK_S."""
    tracker = Tracker()
    assert sentinel.tick_s(tracker, 100.0) == sentinel.TICK_S
    with tracker.timed():
        start = tracker.timing_since
        assert sentinel.tick_s(tracker, start + 0.5) == sentinel.TIMING_TICK_S
        assert sentinel.tick_s(tracker, start + sentinel.TIMING_QUIET_MAX_S + 0.1) == sentinel.TICK_S
    assert sentinel.TICK_S < sentinel.TIMING_TICK_S <= 1.0
