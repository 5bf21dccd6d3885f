"""Out-of-band exchange through the c10d store, with deadlines.

Nothing here touches a process group, so it keeps working when a collective is hung or a
peer is dead. Each rank posts JSON under `KEY/RANK` and bumps a counter `KEY/n`; a reader
polls the counter (one round trip) and fetches the values once they are all there. A rank
that never posts becomes a missing entry for the reader to report, never a hang.

At scale (issue 21: 1k-16k ranks on one store, torchrun's own, which rendezvous and NCCL setup
use too) every path costs the store O(N) requests at most, and polls cost it a fixed budget
whatever N: values are read in batches of BATCH keys (one multi_get of 16k keys x 4 KB took
20.7 s on torch 2.13's store, in batches of 256 keys 0.07 s); presence is the counter when
every rank posted, else one `check` of a whole batch, split only where a key is missing; and a
wait polls every max(poll_s, N / POLL_BUDGET_OPS_S) seconds per rank (`poll_interval`).

Every call is bounded: a c10d TCPStore client waits forever for a server that is stopped
(SIGSTOP of torchrun's agent, a frozen host), whatever timeout the store was made with (seen
with torch 2.13: `add` on a client with a 2 s timeout was still waiting after 100 s). A rank
in that state can report nothing, so once `bound_store_calls` was called (the check does; an
embedded watchdog must never end its training process for this) a watcher thread ends the
process (exit 3, one line) when a call has been waiting STORE_STALL_S.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

from distdiag.report.fastjson import loads
from distdiag.runtime.snapwire import MAGIC, decode

T = TypeVar("T")

__all__ = ["Exchange", "STORE_STALL_S", "BATCH", "POLL_BUDGET_OPS_S", "bound_store_calls", "bounded", "poll_interval"]

PART_BYTES = 63 * 1024
"""The largest value Exchange sets; a larger one goes in parts (under the 64 KB every store
value is kept to: runtime/keys.py MAX_STORE_VALUE)."""
PARTS = "__distdiag_parts__"
"""The one key of the small value that stands for a value set in parts."""

STORE_STALL_S = 30.0
"""How long one call to the job's store may wait for an answer before the rank gives up on
the store and leaves with exit 3 (a round trip takes milliseconds; seconds on a loaded node)."""

BATCH = 256
"""Keys per multi_get or check: the server answers a request whole, so one of 16k values
holds it (and every other client) for seconds."""

PREFETCH_PARTS = 4
"""From this many multi_gets on, Exchange.collect reads the next while it parses one."""

POLL_BUDGET_OPS_S = 25_000.0
"""Requests per second that all ranks polling one wait may cost the store together: about a
quarter of one core of torch's TCPStore server (~10 us a request). A wait's own poll_s holds
up to 25,000 / poll_s ranks (250 at the check's 10 ms); beyond, each rank polls less often."""


def poll_interval(poll_s: float, world: int) -> float:
    """The interval one rank of `world` polls at, for a wait that asks for poll_s."""
    return max(poll_s, world / POLL_BUDGET_OPS_S)


_inflight: dict[int, tuple[float, str]] = {}
_watcher: list[threading.Thread] = []
_watcher_lock = threading.Lock()


def _watch(rank: int, leave: Callable[[], None]) -> None:
    from distdiag.errors import print_line

    while True:
        time.sleep(0.5)
        now = time.monotonic()
        stalled = [(now - start, op) for start, op in list(_inflight.values()) if now - start > STORE_STALL_S]
        if stalled:
            waited, op = max(stalled)
            try:
                print_line(f"distdiag[rank {rank}]: the job's store has not answered '{op}' for {waited:.0f}s (its "
                           "host stopped or frozen?); nothing can be reported through it; exiting 3")
            except OSError:
                pass  # stderr was a pipe to a launcher that is gone: leave all the same
            leave()
            return


def bound_store_calls(rank: int, leave: Callable[[], None]) -> None:
    """From now on, a store call of this process that waits STORE_STALL_S makes the process
    say so and call `leave` (which must end it: the sentinel's flush_and_exit(3))."""
    with _watcher_lock:
        if not _watcher or not _watcher[0].is_alive():
            thread = threading.Thread(target=_watch, args=(rank, leave), name="distdiag-store-watch", daemon=True)
            thread.start()
            _watcher[:] = [thread]


@contextmanager
def bounded(op: str) -> Iterator[None]:
    """Count the block as one store call `op`, bounded once bound_store_calls was called."""
    key = threading.get_ident()
    _inflight[key] = (time.monotonic(), op)
    try:
        yield
    finally:
        _inflight.pop(key, None)


class Exchange:
    """Store-backed gather/publish for one rank. Not shared between threads (its `collect`
    reads ahead on a thread of its own; the store client serialises its requests)."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        # Any: a torch.distributed.Store, whose stubs take str values where the store takes bytes too
        self.store = store
        self.rank = rank
        self.world_size = world_size

    def post(self, key: str, value: object) -> None:
        """Publish this rank's value under key and count it (in parts if it is large)."""
        with bounded(f"set {key}"):
            self._set(f"{key}/{self.rank}", json.dumps(value, default=str))
            self.store.add(f"{key}/n", 1)

    def put(self, key: str, data: str | bytes) -> None:
        """Set one value under its full key, in parts if it is large (no count)."""
        with bounded(f"set {key}"):
            self._set(key, data)

    def _set(self, key: str, text: str | bytes) -> None:
        """Set one value (JSON text, or a packed snapshot: distdiag/runtime/snapwire.py); over
        PART_BYTES it goes in parts under KEY/part/I, and KEY holds {PARTS: count}, set last (a
        reader that sees KEY finds its parts there): no value over 64 KB reaches the store,
        whatever a probe or a user's target posts (issue 21)."""
        data = text.encode() if isinstance(text, str) else text
        if len(data) <= PART_BYTES:
            self.store.set(key, data)
            return
        count = 0
        for count, start in enumerate(range(0, len(data), PART_BYTES), 1):
            self.store.set(f"{key}/part/{count - 1}", data[start : start + PART_BYTES])
        self.store.set(key, json.dumps({PARTS: count}))

    def _loads(self, key: str, raw: bytes | None) -> Any:
        """A value set by _set, its parts read back when it was split."""
        value = decode(raw)
        if isinstance(value, dict) and len(value) == 1 and PARTS in value:
            keys = [f"{key}/part/{i}" for i in range(int(value[PARTS]))]
            parts: list[bytes] = []
            for start in range(0, len(keys), BATCH):
                parts += [bytes(p) for p in self.store.multi_get(keys[start : start + BATCH])]
            value = decode(b"".join(parts))
        return value

    def count(self, key: str) -> int:
        with bounded(f"add {key}/n"):
            return int(self.store.add(f"{key}/n", 0))

    def wait_count(
        self,
        key: str,
        expected: int,
        deadline: float,
        *,
        poll_s: float = 0.01,
        stop: Callable[[], bool] | None = None,
        alone: bool = False,
    ) -> bool:
        """Wait until `expected` ranks posted under key; False at the deadline or on stop().
        `alone`: this rank polls at poll_s whatever the world (one rank's polls cost the store
        nothing; the check's writer learns at once that the last rank posted, issue 21)."""
        interval = poll_s if alone else poll_interval(poll_s, self.world_size)
        return _poll(lambda: self.count(key) >= expected, deadline, interval, stop, scaled=interval > poll_s) is not None

    def present(self, key: str, ranks: list[int] | None = None) -> list[int]:
        """The ranks (of `ranks`, default all) that posted under key. One round trip when
        everyone or no one posted; else one check per BATCH keys, split in halves only where a
        key is missing (a few silent ranks cost ~2 log2(BATCH) checks each, never N)."""
        if ranks is None:
            ranks = list(range(self.world_size))
            posted = self.count(key)
            if posted >= self.world_size:  # everyone posted: one round trip
                return ranks
            if posted <= 0:
                return []
        found: list[int] = []
        for start in range(0, len(ranks), BATCH):
            found += self._present_in(key, ranks[start : start + BATCH])
        return found

    def _present_in(self, key: str, ranks: list[int]) -> list[int]:
        """The ranks of `ranks` whose key exists: a check of them all (True only when every
        key exists), halved on a miss."""
        if not ranks:
            return []
        with bounded(f"check {key}"):
            if self.store.check([f"{key}/{r}" for r in ranks]):
                return list(ranks)
        if len(ranks) == 1:
            return []
        half = len(ranks) // 2
        return self._present_in(key, ranks[:half]) + self._present_in(key, ranks[half:])

    def collect(self, key: str, ranks: list[int] | None = None) -> dict[int, Any]:
        """The values posted so far under key, by rank (missing ranks are absent); read
        BATCH keys a request."""
        have = self.present(key, ranks)
        parts = [have[start : start + BATCH] for start in range(0, len(have), BATCH)]
        out: dict[int, Any] = {}
        for part, raw in zip(parts, self._fetched(key, parts), strict=True):
            out.update(zip(part, self._batch(key, part, raw), strict=True))
        return out

    def _get(self, key: str, part: list[int]) -> list[Any]:
        with bounded(f"multi_get {key}"):
            return self.store.multi_get([f"{key}/{r}" for r in part])

    def _fetched(self, key: str, parts: list[list[int]]) -> Iterator[list[Any]]:
        """Each part's raw values, in order. Past PREFETCH_PARTS parts the next is read on a
        second thread while the caller parses this one: a read waits on the server (busy with
        every other rank's polls) with the GIL released, the parsing needs the GIL; the client
        serialises its own requests."""
        if len(parts) < PREFETCH_PARTS:
            yield from (self._get(key, part) for part in parts)
            return
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="distdiag-prefetch") as pool:
            pending = pool.submit(self._get, key, parts[0])
            for part in parts[1:]:
                raw = pending.result()
                pending = pool.submit(self._get, key, part)
                yield raw
            yield pending.result()

    def _batch(self, key: str, part: list[int], raw: list[Any]) -> list[Any]:
        """The values of one multi_get: the JSON ones parsed as one array (16k values one by one
        cost ~30 us each in calls alone), packed ones and those set in parts one by one."""
        data = [v if isinstance(v, bytes) else bytes(v) for v in raw]
        plain = [i for i, v in enumerate(data) if not v.startswith(MAGIC)]
        values: list[Any] = [None] * len(data)
        if plain:
            for i, value in zip(plain, loads(b"[" + b",".join([data[i] for i in plain]) + b"]"), strict=True):
                values[i] = value
        whole = set(plain)
        for i, v in enumerate(data):
            value = values[i]
            if i not in whole or (isinstance(value, dict) and len(value) == 1 and PARTS in value):
                values[i] = self._loads(f"{key}/{part[i]}", v)
        return values

    def publish(self, key: str, value: object) -> None:
        """Set one job-wide value (e.g. the verdict; in parts if it is large)."""
        with bounded(f"set {key}"):
            self._set(key, json.dumps(value, default=str))

    def read(self, key: str) -> Any | None:
        """A job-wide value, or None when nobody set it yet."""
        with bounded(f"get {key}"):
            if not self.store.check([key]):
                return None
            return self._loads(key, self.store.get(key))

    def wait_read(
        self, key: str, deadline: float, *, poll_s: float = 0.02, stop: Callable[[], bool] | None = None
    ) -> Any | None:
        """The job-wide value once someone sets it; None at the deadline or on stop()."""
        interval = poll_interval(poll_s, self.world_size)
        return _poll(lambda: self.read(key), deadline, interval, stop, scaled=interval > poll_s)

    def claim(self, key: str, who: str = "") -> bool:
        """Atomically claim a role; True for exactly one caller.

        `who` tells callers of one rank apart (its main thread and its sentinel may both try:
        a token of the rank alone would let both win).
        """
        token = f"{self.rank}:{who}" if who else str(self.rank)
        with bounded(f"compare_set {key}"):
            got = self.store.compare_set(key, "", token)
        return bytes(got).decode() == token

    def bump(self, key: str, amount: int = 1) -> int:
        with bounded(f"add {key}"):
            return int(self.store.add(key, amount))


def _poll(
    probe: Callable[[], T | None], deadline: float, poll_s: float, stop: Callable[[], bool] | None, *, scaled: bool = False
) -> T | None:
    """probe()'s first value that is not None or False, polling with a backoff up to poll_s;
    None at the deadline or once stop() says so (probe is always tried at least once).
    `scaled`: poll_s was stretched for a large world: no quick first polls (N ranks arriving
    together would send them all at once), and the first one at a random point of the
    interval, so that the ranks' polls spread over it."""
    delay = poll_s * random.uniform(0.5, 1.0) if scaled else poll_s / 4
    while True:
        value = probe()
        if value is not None and value is not False:
            return value
        if time.monotonic() >= deadline or (stop is not None and stop()):
            return None
        time.sleep(min(delay, max(0.0, deadline - time.monotonic()) + 0.001))
        delay = min(poll_s, delay * 2)
