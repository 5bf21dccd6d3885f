"""Collective digests compared at step marks, between each group's ranks, through the store.

At every step mark a rank records two numbers per group it used (collectives issued, a
running CRC of their fingerprints; distdiag.watchdog.progress). The group's lowest rank posts
its last MARK_WINDOW marks under `marks/RANK`; every other rank of the group reads them and
compares its own marks with them, mark by mark. The first difference is a desync, which the
watchdog thread (distdiag.watchdog.watcher) declares.
"""

from __future__ import annotations

import json
import time
from typing import Any

from distdiag.hang.groupid import group_members
from distdiag.runtime.exchange import Exchange
from distdiag.runtime.keys import Keys
from distdiag.watchdog.progress import Progress

__all__ = ["MarkComparer", "MARK_WINDOW"]

MARK_WINDOW = 32
"""Step marks the group's lowest rank keeps in the store for the others to compare with."""


class MarkComparer:
    """One rank's side of the comparison: its marks not yet settled, and what it posted as a lead."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank = rank
        self.world = world
        self._mark_next = 0
        self._my_marks: dict[int, tuple[Any, dict[str, list[int]]]] = {}
        self._posted: dict[str, dict[str, list[int]]] = {}
        self._labels: dict[str, list[int] | None] = {}
        self._checked_at = float("-inf")

    def _ranks_of(self, label: str) -> list[int] | None:
        if label not in self._labels:
            self._labels[label] = group_members(label, self.world)  # None: not compared
        return self._labels[label]

    def compare(self, ex: Exchange, progress: Progress, every: float = 0.0) -> dict[str, Any] | None:
        """Take the new marks, post them where this rank leads a group, compare the rest (at
        most every `every` seconds): the desync's detail at the first difference, else None."""
        marks = [m for m in list(progress.marks) if m[0] >= self._mark_next]
        if not marks and not self._my_marks:
            return None
        if self._take(marks):
            self._post(ex, marks)
        now = time.monotonic()
        if now - self._checked_at < every:
            return None
        self._checked_at = now
        return self._check(ex)

    def _take(self, marks: list[tuple[int, Any, dict[str, list[int]]]]) -> bool:
        """Keep the new marks to check; True when this rank leads a group they name."""
        lead = False
        for index, step, digest in marks:
            self._my_marks[index] = (step, digest)
            self._mark_next = index + 1
            for label in digest:
                ranks = self._ranks_of(label)
                if ranks and ranks[0] == self.rank:
                    lead = True
        return lead

    def _post(self, ex: Exchange, marks: list[tuple[int, Any, dict[str, list[int]]]]) -> None:
        """As a group's lowest rank: the last MARK_WINDOW marks, for the group's others to read."""
        for index, _step, digest in marks:
            self._posted[str(index)] = digest
        for old in sorted(self._posted, key=int)[:-MARK_WINDOW]:
            del self._posted[old]
        ex.store.set(Keys.marks(self.rank), json.dumps(self._posted))

    def _check(self, ex: Exchange) -> dict[str, Any] | None:
        """Compare the marks kept with the reference ranks' windows; drop those settled."""
        refs: dict[int, dict[str, Any] | None] = {}
        for index in sorted(self._my_marks):
            step, digest = self._my_marks[index]
            done = True
            for label, mine in digest.items():
                ranks = self._ranks_of(label)
                if not ranks or ranks[0] == self.rank:
                    continue
                ref = ranks[0]
                if ref not in refs:
                    refs[ref] = ex.read(Keys.marks(ref))
                window = refs[ref]
                if not window:  # not posted yet (None) or empty
                    done = False
                    continue
                theirs_all = window.get(str(index))
                if theirs_all is None:
                    if index > max(int(k) for k in window):
                        done = False  # the reference rank has not reached this mark yet
                    continue
                theirs = theirs_all.get(label, [0, 0])
                if list(theirs) != list(mine):
                    return {"group": label, "step": step, "mark": index, "rank": self.rank, "ref": ref,
                            "mine": mine[0], "theirs": theirs[0]}
            if done or len(self._my_marks) > 4 * MARK_WINDOW:
                del self._my_marks[index]
        return None
