"""What the training thread did last: collectives with their fingerprints, step marks, phases.

The training thread writes (cheap attribute and deque updates, no locks, no store I/O); the
watchdog thread reads under the GIL and turns it into a snapshot. Every collective gets a
fingerprint - op, group, shape, dtype, call site - and a sequence number per group; a
running CRC per group over those fingerprints lets ranks compare whole histories at a step
mark by exchanging two numbers per group (distdiag.watchdog.monitor).
"""

from __future__ import annotations

import collections
import threading
import time
import zlib
from typing import Any

from distdiag.hang import SHAPE_FREE_OPS
from distdiag.tracker import thread_stack

__all__ = ["Progress", "Record", "P2P_GROUP"]

P2P_GROUP = "p2p"
"""Point-to-point ops pair two ranks, not a group: tracked as state, left out of the digests."""
# Ops whose shapes may differ between ranks (hang.SHAPE_FREE_OPS): only the op enters the
# digest. The digest leaves call sites out too (`if rank == 0: broadcast(...) else: broadcast(...)` is
# fine); the analysis uses them to locate a skip or an extra call once counts disagree.


class Record:
    """One collective as this rank issued it."""

    __slots__ = ("op", "group", "seq", "shape", "dtype", "site", "step", "t0", "t1", "is_async")

    def __init__(self, op: str, group: str, seq: int, shape: Any, dtype: str, site: str, step: Any, is_async: bool) -> None:
        self.op = op
        self.group = group
        self.seq = seq
        self.shape = shape
        self.dtype = dtype
        self.site = site
        self.step = step
        self.is_async = is_async
        self.t0 = time.monotonic()
        self.t1 = 0.0

    def fingerprint(self) -> str:
        return f"{self.op}|{self.shape}|{self.dtype}|{self.site}"

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        data: dict[str, Any] = {
            "op": self.op,
            "group": self.group,
            "seq": self.seq,
            "shape": list(self.shape) if isinstance(self.shape, tuple) else self.shape,
            "dtype": self.dtype,
            "call_site": self.site,
            "step": self.step,
            "fp": self.fingerprint(),
        }
        if self.is_async:
            data["async"] = True
        if self.t1:
            data["duration_s"] = round(self.t1 - self.t0, 6)
        elif now is not None:
            data["for_s"] = round(now - self.t0, 3)
        return data


class Progress:
    """The training thread's side of the watchdog."""

    def __init__(self, history: int, thread_ident: int | None = None) -> None:
        self.thread_ident = thread_ident if thread_ident is not None else threading.get_ident()
        self.step: Any = None
        self.last_progress = time.monotonic()
        self.step_since = self.last_progress
        self.current: Record | None = None
        self.pending_async: dict[int, Record] = {}
        self.records: collections.deque[Record] = collections.deque(maxlen=history)
        self.seq: dict[str, int] = {}
        self.crc: dict[str, int] = {}
        self.marks: collections.deque[tuple[int, Any, dict[str, list[int]]]] = collections.deque(maxlen=256)
        """(index of the mark, the user's step, {group: [collectives so far, running CRC]})."""
        self.mark_total = 0
        self.phases: list[tuple[str, float, float]] = []
        """Declared phases, innermost last: (name, budget in s, since)."""
        self.since_step = 0
        self.total = 0
        self.depth = 0
        self._shape_free: dict[str, bool] = {}
        """op -> whether only the op enters the digest (SHAPE_FREE_OPS), so the hot path tests it once per op."""

    # -- written by the training thread ------------------------------------------------------
    def begin(self, op: str, group: str, shape: Any, dtype: str, site: str, is_async: bool) -> Record:
        if group == P2P_GROUP:
            rec = Record(op, group, 0, shape, dtype, site, self.step, is_async)
        else:
            seq = self.seq.get(group, 0) + 1
            self.seq[group] = seq
            rec = Record(op, group, seq, shape, dtype, site, self.step, is_async)
            shape_free = self._shape_free.get(op)
            if shape_free is None:
                shape_free = self._shape_free[op] = op.rsplit(":", 1)[-1] in SHAPE_FREE_OPS
            key = op if shape_free else f"{op}|{shape}|{dtype}"
            self.crc[group] = zlib.crc32(key.encode(), self.crc.get(group, 0))
        self.records.append(rec)
        self.since_step += 1
        self.total += 1
        if is_async:
            self.pending_async[id(rec)] = rec
            self.last_progress = rec.t0
        else:
            self.current = rec
        return rec

    def end(self, rec: Record) -> None:
        rec.t1 = self.last_progress = time.monotonic()
        if self.current is rec:
            self.current = None

    def async_done(self, rec: Record) -> None:
        """Called on the backend's thread when an async collective completes."""
        rec.t1 = self.last_progress = time.monotonic()
        self.pending_async.pop(id(rec), None)

    def mark_step(self, step: Any) -> None:
        now = time.monotonic()
        self.step = step
        self.step_since = self.last_progress = now
        self.since_step = 0
        self.marks.append((self.mark_total, step, {g: [self.seq[g], self.crc[g]] for g in self.crc}))
        self.mark_total += 1

    def enter_phase(self, name: str, budget_s: float) -> None:
        now = time.monotonic()
        self.phases.append((name, budget_s, now))
        self.last_progress = now

    def exit_phase(self) -> None:
        if self.phases:
            self.phases.pop()
        self.last_progress = time.monotonic()

    # -- read by the watchdog thread -----------------------------------------------------
    def in_flight(self) -> Record | None:
        """The sync collective the thread is inside, else the oldest unfinished async one."""
        cur = self.current
        if cur is not None:
            return cur
        pending = list(self.pending_async.values())
        return min(pending, key=lambda r: r.t0) if pending else None

    def history(self) -> list[Record]:
        for _ in range(5):
            try:
                recs = list(self.records)
                break
            except RuntimeError:  # mutated while copying: try again
                continue
        else:
            recs = []
        return recs

    def stack(self, limit: int = 24) -> list[str]:
        return thread_stack(self.thread_ident, limit)

    def snapshot(self, history: int, *, finished: bool = False) -> dict[str, Any]:
        """A JSON-able picture in the shape distdiag.hang reads (plus step and history)."""
        now = time.monotonic()
        rec = self.in_flight()
        phases = list(self.phases)
        where = f"phase '{phases[-1][0]}'" if phases else (f"step {self.step}" if self.step is not None else "training")
        history_dicts = [r.to_dict() for r in self.history()[-history:]]
        return {
            "phase": "barrier" if finished else "training",
            "phase_for_s": round(now - (phases[-1][2] if phases else self.step_since), 3),
            "probe_index": -1,
            "probe": where,
            "step": self.step,
            "in_collective": rec.to_dict(now) if rec is not None and not finished else None,
            "collectives_in_probe": self.since_step,
            "collectives_total": self.total,
            "no_progress_s": round(now - self.last_progress, 3),
            "phases": [{"name": n, "budget_s": b, "for_s": round(now - s, 3)} for n, b, s in phases],
            "recent": history_dicts[-8:],  # history >= 16 (config), so recent is its tail
            "history": history_dicts,
            "stack": [] if finished else self.stack(),
        }
