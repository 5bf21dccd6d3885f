"""A rank that never posted its row of the rank table is named as never checked in, on its host
when every rank starts on one, not as "no answer from host ?" (issue 24)."""

from __future__ import annotations

from distdiag.check.finish import RunEnd
from distdiag.report.model import RankInfo
from distdiag.runtime.sentinel import silent_rank_reasons


def test_the_placeholder_row_of_a_rank_that_never_checked_in_is_not_taken_for_a_host():
    end = RunEnd.__new__(RunEnd)  # only the rank table is needed here
    end.rank_infos = [RankInfo(0, "vm", 0, 0, "cpu", 4341), RankInfo(1, "?", -1, -1, "?", -1)]
    infos = end._checked_in()
    assert list(infos) == [0]
    (why,) = silent_rank_reasons([1], infos, "vm", starting_host="vm").values()
    assert why.startswith("it never checked in (no rank table entry) on host vm: it was still starting"), why
    assert "host ?" not in why


def test_a_checked_in_rank_on_another_host_is_no_answer_from_that_host():
    """Healthy twin of the naming: a real row on another host still reads 'no answer from host'."""
    infos = {1: RankInfo(1, "node-b", 1, 0, "cpu", 77)}
    assert silent_rank_reasons([1], infos, "node-a") == {1: "no answer from host node-b (dead, stopped or unreachable)"}
