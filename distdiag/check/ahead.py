"""Rank 0 consolidates each probe's results while the ranks run the next probe (issue 21).

At 16,384 ranks, reading every probe's results (~17 KB a rank, 280 MB in all) and consolidating
them after the last probe took 2.8 s of the 4.1 s between the last result and the verdict. Each
probe's results are complete the moment every rank posted them (rank 0's barrier returns then),
so rank 0 hands that probe to a thread of its own and goes on to the next probe; after the last
one only the last probe is left to read. Rank 0's share of a probe is mostly waiting in
collectives (the GIL released), which is when this thread runs; no probe of the default suite
compares ranks by how long rank 0 took, and before one that does (`Probe.times_ranks`:
bandwidth) rank 0 waits for this thread to finish (`drain`), so it cannot make rank 0 look slow.

The thread reads through a store client of its own (one more connection, rank 0's only): its
multi_gets of 4 MB would otherwise queue rank 0's barrier polls behind them.
Whatever it could not do (its client failed, a store error) is left undone, and the writer
consolidates that probe itself, as before: the thread saves time, never a result.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from distdiag.report.model import ProbeResult
from distdiag.runtime.exchange import Exchange
from distdiag.runtime.gcpause import collector_paused

__all__ = ["Ahead"]

log = logging.getLogger("distdiag.check")

_DONE = -1


class Ahead:
    """The probes consolidated so far, by index, filled on a thread as each probe completes.

    `consolidate(ex, index)` makes one probe's result (RunEnd.consolidated); `connect()` gives
    the thread its own Exchange (None: it uses `ex`, the caller's, whose client serialises the
    two threads' requests); `prepare(ex)` runs on the thread first (reading the rank table: 0.2 s
    at 16k ranks that rank 0's setup, which every rank waits for, need not spend)."""

    def __init__(self, consolidate: Callable[[Exchange, int], ProbeResult], ex: Exchange,
                 connect: Callable[[], Exchange] | None = None, prepare: Callable[[Exchange], None] | None = None) -> None:
        self._consolidate = consolidate
        self._prepare = prepare
        self._ex = ex
        self._connect = connect
        self._todo: queue.Queue[int] = queue.Queue()
        self._results: dict[int, ProbeResult] = {}
        self._idle = threading.Event()
        self._idle.set()
        self._lock = threading.Lock()
        self._pending = 0
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="distdiag-consolidate", daemon=True)
        self._thread.start()

    def ready(self, index: int) -> None:
        """Every rank posted its result of probe `index`: consolidate it now."""
        if self._stopped:
            return
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._todo.put(index)

    def result(self, index: int) -> ProbeResult | None:
        """Probe `index`'s result, if the thread made it (read from any thread: one dict get)."""
        return self._results.get(index)

    def drain(self) -> None:
        """Wait until every probe handed over is consolidated (or the thread is gone)."""
        while not self._idle.wait(1.0) and self._thread.is_alive():
            pass

    def finish(self) -> None:
        """drain, then stop."""
        self.drain()
        self.stop()

    def stop(self) -> None:
        """Take no more probes (an aborted run: the writer reads what is done, does the rest)."""
        self._stopped = True
        self._todo.put(_DONE)

    def _exchange(self) -> Exchange:
        if self._connect is None:
            return self._ex
        try:
            return self._connect()
        except Exception as exc:  # noqa: BLE001 - the caller's client serves as well, only slower
            log.debug("the consolidating thread's own store client: %s", exc)
            return self._ex

    def _run(self) -> None:
        ex = self._exchange()
        try:
            if self._prepare is not None:
                self._prepare(ex)
        except Exception as exc:  # noqa: BLE001 - then nothing is made ahead: the writer does it all
            log.debug("preparing to consolidate ahead failed: %s: %s", type(exc).__name__, exc)
            self._stopped = True
        while True:
            index = self._todo.get()
            if index == _DONE or self._stopped:
                with self._lock:
                    self._pending = 0
                    self._idle.set()
                return
            try:
                # No freeze at the end: the young objects then are rank 0's running probe's too
                # (a released model's cycles must stay collectable), not only this thread's.
                with collector_paused(freeze=False):
                    self._results[index] = self._consolidate(ex, index)
            except Exception as exc:  # noqa: BLE001 - the writer consolidates it itself
                log.debug("consolidating probe %d ahead failed: %s: %s", index, type(exc).__name__, exc)
            with self._lock:
                self._pending -= 1
                if self._pending == 0:
                    self._idle.set()
