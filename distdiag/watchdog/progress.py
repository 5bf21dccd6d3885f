"""What the training thread did last: steps, phases, and the collectives our wrappers saw.

The training thread writes (cheap attribute and deque updates, no locks, no store I/O); the
watchdog thread reads under the GIL and turns it into a snapshot. Steps come from the user's
`wd.step(n)` marks or, without them, from torch's global optimizer step hook (every
`optimizer.step()`, no code change). Compilation (torch.compile) is an automatic phase with
its own budget. When the wrappers are on (distdiag.watchdog.intercept), every collective they
see gets a fingerprint - op, group, shape, dtype, call site - and a sequence number per
group; a running CRC per group over those fingerprints lets ranks compare whole histories at
a step mark by exchanging two numbers per group (distdiag.watchdog.marks). Where each rank
is in the collectives torch issues itself comes from the engine (distdiag.hang.recorder), read by
the watchdog thread, not from here.
"""

from __future__ import annotations

import collections
import dis
import functools
import re
import sys
import threading
import time
import zlib
from typing import Any

from distdiag.hang import SHAPE_FREE_OPS
from distdiag.runtime.tracker import CollectiveRecord, thread_stack

__all__ = ["Progress", "P2P_GROUP"]

P2P_GROUP = "p2p"
_P2P_PEER = re.compile(r"^i?(?:send|recv)\((src|dst)=(\d+)\)$")


@functools.lru_cache(maxsize=1024)
def _p2p_way(op: str) -> tuple[str, int] | None:
    """('sent' | 'received', peer) of a send/recv label ('isend(dst=1)'), None for others."""
    m = _P2P_PEER.search(op)
    return None if m is None else ("received" if m.group(1) == "src" else "sent", int(m.group(2)))
"""Point-to-point ops pair two ranks, not a group: tracked as state, left out of the digests."""
# Ops whose shapes may differ between ranks (hang.SHAPE_FREE_OPS): only the op enters the
# digest. The digest leaves call sites out too (`if rank == 0: broadcast(...) else: broadcast(...)` is
# fine); the analysis uses them to locate a skip or an extra call once counts disagree.


@functools.lru_cache(maxsize=64)
def _loop_span(code: Any, lasti: int) -> tuple[int, int] | None:
    """(first, last) bytecode offset of the innermost loop of `code` that contains `lasti`:
    a backward jump after it whose target is before it (for and while loops alike)."""
    # One loop may end in several backward jumps to its head (3.11+ emits one per branch that
    # ends the body: `if c: ... else: ...` last in the loop): the loop spans to the farthest.
    ends: dict[int, int] = {}
    try:
        for ins in dis.get_instructions(code):
            backward = ins.opname.startswith(("JUMP_BACKWARD", "POP_JUMP_BACKWARD")) or (
                ins.opname == "JUMP_ABSOLUTE" and isinstance(ins.argval, int) and ins.argval < ins.offset
            )
            if backward and isinstance(ins.argval, int) and ins.argval <= ins.offset:
                ends[ins.argval] = max(ends.get(ins.argval, ins.offset), ins.offset)
    except Exception:  # noqa: BLE001 - bytecode we cannot read: the frame alone decides
        return None
    best: tuple[int, int] | None = None
    for start, end in ends.items():
        if start <= lasti <= end and (best is None or end - start < best[1] - best[0]):
            best = (start, end)
    return best


def _loop_tag(frame: Any, event: str, arg: Any) -> None:
    """The tag Progress puts in frames' f_trace at a step (a no-op tracer, should one run)."""
    return None


class Progress:
    """The training thread's side of the watchdog."""

    def __init__(self, history: int, thread_ident: int | None = None) -> None:
        self.thread_ident = thread_ident if thread_ident is not None else threading.get_ident()
        self.step: Any = None
        self.last_progress = time.monotonic()
        self.step_since = self.last_progress
        self.current: CollectiveRecord | None = None
        self.pending_async: dict[int, CollectiveRecord] = {}
        self.poll_works: dict[int, tuple[CollectiveRecord, list[Any]]] = {}
        """Async records whose Work has no future (gloo send/recv): the watchdog's tick polls them."""
        self.records: collections.deque[CollectiveRecord] = collections.deque(maxlen=history)
        self.seq: dict[str, int] = {}
        self.crc: dict[str, int] = {}
        self.marks: collections.deque[tuple[int, Any, dict[str, list[int]]]] = collections.deque(maxlen=256)
        """(index of the mark, the user's step, {group: [collectives so far, running CRC]})."""
        self.mark_total = 0
        self.phases: list[tuple[str, float, float]] = []
        """Declared phases, innermost last: (name, budget in s, since)."""
        self.since_step = 0
        self.total = 0
        self.p2p: dict[str, dict[int, int]] = {"sent": {}, "received": {}}
        """Point-to-point ops issued, per peer (global rank): a pair whose counts part names the
        rank that skipped a send (a recv waits for it for ever)."""
        self.depth = 0
        self.explicit = False
        """True once the user marked a step (wd.step): then a rank idle for the timeout is hung even
        outside collectives. Optimizer steps alone never make long compute a hang."""
        self.steps = 0
        """Steps taken: the user's marks, else optimizer steps."""
        self.step_times: collections.deque[float] = collections.deque(maxlen=33)
        self.step_walls: collections.deque[tuple[int, Any]] = collections.deque(maxlen=64)
        """(wall-clock ns, step) at each step: the recorder stamps its entries with wall-clock
        time, so without wrappers these give each recorded collective its step."""
        self.loop_span: tuple[int, int] | None = None
        """Bytecode offsets of the innermost loop around the step call in that frame: code after
        the loop (a final checkpoint) runs in the same frame, outside this span."""
        self.loop_frame: tuple[int, Any] | None = None
        """(id, code) of the training loop's frame: the deepest frame on the stack at two
        consecutive steps. A rank whose stack no longer holds it has left the loop."""
        self.loaders: Any = None
        self.groups: Any = None
        """distdiag.watchdog.groupnames.GroupLog: the numbered groups this rank created."""
        """The DataLoader tap (distdiag.watchdog.dataload.LoaderTap) when installed: each pass's
        batches drawn and whether it ran out, the evidence that tells uneven data apart."""
        self._shape_free: dict[str, bool] = {}
        """op -> whether only the op enters the digest (SHAPE_FREE_OPS), so the hot path tests it once per op."""

    # -- written by the training thread ------------------------------------------------------
    def begin(self, op: str, group: str, shape: Any, dtype: str, site: str, is_async: bool) -> CollectiveRecord:
        if group == P2P_GROUP:
            rec = CollectiveRecord(op, group, 0, shape, dtype, site, self.step, is_async)
            counted = _p2p_way(op)  # cached: this runs on the training thread at every send/recv
            if counted is not None:
                way = self.p2p[counted[0]]
                way[counted[1]] = way.get(counted[1], 0) + 1
        else:
            seq = self.seq.get(group, 0) + 1
            self.seq[group] = seq
            rec = CollectiveRecord(op, group, seq, shape, dtype, site, self.step, is_async)
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

    def end(self, rec: CollectiveRecord) -> None:
        rec.t1 = self.last_progress = time.monotonic()
        if self.current is rec:
            self.current = None

    def _p2p_view(self) -> dict[str, Any] | None:
        """Sends issued and receives posted per peer, and the point-to-point ops still pending
        (oldest first, 16 at most: `in_collective` names only the oldest of all)."""
        if not any(self.p2p.values()):
            return None
        pending = sorted((r for r in list(self.pending_async.values()) if r.group == P2P_GROUP), key=lambda r: r.t0)
        return {**{way: dict(counts) for way, counts in self.p2p.items()}, "pending": [r.op for r in pending[:16]]}

    def poll_async(self) -> None:
        """On the watchdog's tick: the polled works that completed are done (gloo's p2p Work)."""
        for key, (rec, works) in list(self.poll_works.items()):
            try:
                done = all(w.is_completed() for w in works)
            except Exception:  # noqa: BLE001 - a work we cannot ask: count it done
                done = True
            if done:
                self.poll_works.pop(key, None)
                self.async_done(rec)

    def async_done(self, rec: CollectiveRecord) -> None:
        """Called on the backend's thread when an async collective completes."""
        rec.t1 = self.last_progress = time.monotonic()
        self.pending_async.pop(id(rec), None)

    def mark_step(self, step: Any) -> None:
        now = time.monotonic()
        if not self.explicit:  # the first mark: optimizer steps counted so far give way to marks
            self.explicit = True
            self.steps = 0
            self.step_times.clear()
        self.step = step
        self.step_since = self.last_progress = now
        self.since_step = 0
        self.steps += 1
        self.step_times.append(now)
        self.step_walls.append((time.time_ns(), step))
        self._note_loop_frame()
        self.marks.append((self.mark_total, step, {g: [self.seq[g], self.crc[g]] for g in self.crc}))
        self.mark_total += 1

    def optimizer_step(self, *_args: Any) -> None:
        """torch's global optimizer step post-hook: a step when the user marks none."""
        now = time.monotonic()
        self.last_progress = now
        if self.explicit:
            return
        self.steps += 1
        self.step = self.steps
        self.step_since = now
        self.since_step = 0
        self.step_times.append(now)
        self.step_walls.append((time.time_ns(), self.step))
        self._note_loop_frame()

    def _note_loop_frame(self) -> None:
        """Find the loop's frame: the deepest frame that was already on the stack at the last step.

        Frames of a running function are the same objects from one step to the next; the
        step's own frames are new ones (often at a reused address, so ids cannot tell). Each
        step tags the frames on the stack through `f_trace`, which nothing reads while no
        tracer runs; the deepest frame already tagged is the loop. Skipped under a debugger
        or coverage (sys.gettrace()), whose per-frame tracers must not be touched.
        """
        if sys.gettrace() is not None:
            return
        frame: Any = sys._getframe(2)
        chain = []
        while frame is not None:
            chain.append(frame)
            frame = frame.f_back
        for f in chain:  # innermost first: the first tagged one is the deepest
            if f.f_trace is _loop_tag:
                self.loop_frame = (id(f), f.f_code)
                self.loop_span = _loop_span(f.f_code, f.f_lasti)
                break
        for f in chain:
            if f.f_trace is None:
                f.f_trace = _loop_tag

    def in_loop(self) -> bool | None:
        """Whether the training thread is still inside the loop's frame (None: not known yet)."""
        if self.loop_frame is None:
            return None
        frame = sys._current_frames().get(self.thread_ident)
        while frame is not None:
            if frame.f_code is self.loop_frame[1] and frame.f_trace is _loop_tag:
                span = self.loop_span
                return span is None or span[0] <= frame.f_lasti <= span[1]
            frame = frame.f_back
        return False

    def step_cadence(self) -> float | None:
        """The median time between recent steps (None before three steps)."""
        times = list(self.step_times)
        if len(times) < 3:
            return None
        gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
        return gaps[len(gaps) // 2]

    def enter_phase(self, name: str, budget_s: float) -> None:
        now = time.monotonic()
        self.phases.append((name, budget_s, now))
        self.last_progress = now

    def exit_phase(self, name: str | None = None) -> None:
        """Leave the innermost phase (or the innermost one called `name`)."""
        if name is None:
            if self.phases:
                self.phases.pop()
        else:
            for i in range(len(self.phases) - 1, -1, -1):
                if self.phases[i][0] == name:
                    del self.phases[i]
                    break
        self.last_progress = time.monotonic()

    # -- read by the watchdog thread -----------------------------------------------------
    def in_flight(self) -> CollectiveRecord | None:
        """The sync collective the thread is inside, else the oldest unfinished async one."""
        cur = self.current
        if cur is not None:
            return cur
        pending = list(self.pending_async.values())
        return min(pending, key=lambda r: r.t0) if pending else None

    def history(self) -> list[CollectiveRecord]:
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
        cadence = self.step_cadence()
        return {
            "phase": "barrier" if finished else "training",
            "phase_for_s": round(now - (phases[-1][2] if phases else self.step_since), 3),
            "where": where,
            "step": self.step,
            "steps": self.steps,
            "step_source": "marks" if self.explicit else ("optimizer" if self.steps else None),
            "step_for_s": round(now - self.step_since, 3),
            "step_cadence_s": round(cadence, 4) if cadence is not None else None,
            "step_walls": [list(w) for w in list(self.step_walls)],
            "in_loop": None if finished else self.in_loop(),
            "loop": f"{self.loop_frame[1].co_filename} in {self.loop_frame[1].co_name}" if self.loop_frame else None,
            "in_collective": rec.to_dict(now) if rec is not None and not finished else None,
            "collectives_in_probe": self.since_step,
            "collectives_total": self.total,
            "p2p": self._p2p_view(),
            "no_progress_s": round(now - self.last_progress, 3),
            "phases": [{"name": n, "budget_s": b, "for_s": round(now - s, 3)} for n, b, s in phases],
            "recent": history_dicts[-8:],  # history >= 16 (config), so recent is its tail
            "history": history_dicts,
            "stack": [] if finished else self.stack(),
            "loaders": self.loaders.snapshot() if self.loaders is not None else [],
            "groups_created": self.groups.snapshot() if self.groups is not None else None,
        }
