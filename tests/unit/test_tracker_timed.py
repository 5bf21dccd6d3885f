"""Tracker.timed: the flag the sentinel reads to tick slowly while a probe times something."""

from __future__ import annotations

import pytest

from distdiag import sentinel
from distdiag.tracker import Tracker


def test_timed_sets_the_flag_and_clears_it_even_on_error():
    tracker = Tracker()
    assert tracker.timing is False
    with tracker.timed():
        assert tracker.timing is True
    assert tracker.timing is False
    with pytest.raises(RuntimeError), tracker.timed():
        raise RuntimeError("a collective failed mid-loop")
    assert tracker.timing is False


def test_the_timing_tick_is_slower_but_still_within_a_second():
    """Deadlines and a peer's abort are still seen within about a second while timing."""
    assert sentinel.TICK_S < sentinel.TIMING_TICK_S <= 1.0
