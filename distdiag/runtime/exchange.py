"""Out-of-band exchange through the c10d store, with deadlines.

Nothing here touches a process group, so it keeps working when a collective is hung or a
peer is dead. Each rank posts JSON under `KEY/RANK` and bumps a counter `KEY/n`; a reader
polls the counter (one round trip) and fetches the values once they are all there. A rank
that never posts becomes a missing entry for the reader to report, never a hang.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Exchange"]


class Exchange:
    """Store-backed gather/publish for one rank. Not shared between threads."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size

    def post(self, key: str, value: Any) -> None:
        """Publish this rank's value under key and count it."""
        self.store.set(f"{key}/{self.rank}", json.dumps(value, default=str))
        self.store.add(f"{key}/n", 1)

    def count(self, key: str) -> int:
        return int(self.store.add(f"{key}/n", 0))

    def wait_count(
        self,
        key: str,
        expected: int,
        deadline: float,
        *,
        poll_s: float = 0.01,
        stop: Callable[[], bool] | None = None,
    ) -> bool:
        """Wait until `expected` ranks posted under key; False at the deadline or on stop()."""
        return _poll(lambda: self.count(key) >= expected, deadline, poll_s, stop) is not None

    def present(self, key: str, ranks: list[int] | None = None) -> list[int]:
        if ranks is None:
            ranks = list(range(self.world_size))
            if self.count(key) >= self.world_size:  # everyone posted: one round trip
                return ranks
        return [r for r in ranks if self.store.check([f"{key}/{r}"])]

    def collect(self, key: str, ranks: list[int] | None = None) -> dict[int, Any]:
        """The values posted so far under key, by rank (missing ranks are absent)."""
        have = self.present(key, ranks)
        if not have:
            return {}
        raw = self.store.multi_get([f"{key}/{r}" for r in have])
        return {r: json.loads(v) for r, v in zip(have, raw, strict=True)}

    def publish(self, key: str, value: Any) -> None:
        """Set one job-wide value (e.g. the verdict)."""
        self.store.set(key, json.dumps(value, default=str))

    def read(self, key: str) -> Any | None:
        """A job-wide value, or None when nobody set it yet."""
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key))

    def wait_read(
        self, key: str, deadline: float, *, poll_s: float = 0.02, stop: Callable[[], bool] | None = None
    ) -> Any | None:
        """The job-wide value once someone sets it; None at the deadline or on stop()."""
        return _poll(lambda: self.read(key), deadline, poll_s, stop)

    def claim(self, key: str, who: str = "") -> bool:
        """Atomically claim a role; True for exactly one caller.

        `who` tells callers of one rank apart (its main thread and its sentinel may both try:
        a token of the rank alone would let both win).
        """
        token = f"{self.rank}:{who}" if who else str(self.rank)
        got = self.store.compare_set(key, "", token)
        return bytes(got).decode() == token

    def bump(self, key: str, amount: int = 1) -> int:
        return int(self.store.add(key, amount))


def _poll(probe: Callable[[], Any], deadline: float, poll_s: float, stop: Callable[[], bool] | None) -> Any | None:
    """probe()'s first value that is not None or False, polling with a backoff up to poll_s;
    None at the deadline or once stop() says so (probe is always tried at least once)."""
    delay = poll_s / 4
    while True:
        value = probe()
        if value is not None and value is not False:
            return value
        if time.monotonic() >= deadline or (stop is not None and stop()):
            return None
        time.sleep(delay)
        delay = min(poll_s, delay * 2)
