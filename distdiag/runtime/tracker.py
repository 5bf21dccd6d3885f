"""Where the main thread of a rank is: phase, probe, and the collective it is inside.

The main thread writes these fields; the sentinel thread reads them (plain attribute reads
under the GIL) to tell "inside all_reduce #12 on group [0,1] for 41 s" from "computing at
file:line" when a run has to end early.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distdiag.hang.recorder import EngineReader

__all__ = ["Tracker", "main_thread_stack", "thread_stack", "CollectiveRecord"]


_SKIP_FILES = ("tracker.py", "comm.py", "contextlib.py")


class CollectiveRecord:
    """One collective a rank issued: the watchdog's wrappers' (`site`, `step`, async) or the check's
    tracker's (`in_probe`: its number within the probe, the call site as a code object and line).
    Kept raw on the hot path (the bandwidth probe times collectives through it, the training
    thread issues them), turned into a snapshot's dict only when read; each side's dict keeps
    the keys its snapshots have always had."""

    __slots__ = ("op", "group", "seq", "shape", "dtype", "detail", "index", "code", "line", "site", "step", "is_async",
                 "t0", "t1")

    def __init__(self, op: str, group: str, seq: int, shape: Sequence[int] | str | None = None, dtype: object = None,
                 site: str = "", step: int | None = None, is_async: bool = False) -> None:
        # The watchdog's fields only: the training thread makes one a collective. The check's
        # tracker sets its own after (`in_probe`); they are read only when a snapshot is taken.
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
        """When it completed (0.0: not yet)."""

    def in_probe(self, index: int, detail: str, code: CodeType | None, line: int) -> CollectiveRecord:
        """The check's: its number within the probe, the op's detail, the call site as a code
        object and line (formatted only when read)."""
        self.index, self.detail, self.code, self.line = index, detail, code, line
        return self

    def fingerprint(self) -> str:
        """What the watchdog's digests and desync checks compare (op, shape, dtype, call site)."""
        return f"{self.op}|{self.shape}|{self.dtype}|{self.site}"

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        data = self._check_dict() if getattr(self, "index", None) is not None else self._watchdog_dict()
        if self.t1:
            data["duration_s"] = round(self.t1 - self.t0, 6)
        elif now is not None:
            data["for_s"] = round(now - self.t0, 3)
        return data

    def _check_dict(self) -> dict[str, Any]:
        code = self.code
        return {
            "op": f"{self.op}({self.detail})" if self.detail else self.op,
            "group": self.group,
            "seq": self.seq,
            "index_in_probe": self.index,
            "shape": list(self.shape) if self.shape is not None else None,
            "dtype": str(self.dtype).replace("torch.", "") if self.dtype is not None else "none",
            "call_site": f"{code.co_filename}:{self.line} in {code.co_name}" if code is not None else "?",
        }

    def _watchdog_dict(self) -> dict[str, Any]:
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
        return data


def main_thread_stack(limit: int = 16) -> list[str]:
    """The main thread's Python stack, innermost last, as 'file:line in func: code' lines."""
    return thread_stack(threading.main_thread().ident or -1, limit)


def thread_stack(ident: int, limit: int = 16) -> list[str]:
    """A thread's Python stack, innermost last, as 'file:line in func: code' lines."""
    frame = sys._current_frames().get(ident)
    if frame is None:
        return []
    lines = []
    for entry in traceback.extract_stack(frame)[-limit:]:
        code = (entry.line or "").strip()
        lines.append(f"{entry.filename}:{entry.lineno} in {entry.name}" + (f": {code}" if code else ""))
    return lines


class Tracker:
    """Phase and collective bookkeeping of one rank's main thread."""

    def __init__(self) -> None:
        self.phase = "setup"
        self.phase_since = time.monotonic()
        self.probe_index = -1
        self.probe_name = ""
        self.in_collective: CollectiveRecord | None = None
        self.collectives_in_probe = 0
        self.seq: dict[str, int] = collections.defaultdict(int)
        self.recent: collections.deque[CollectiveRecord] = collections.deque(maxlen=8)
        self._engine: EngineReader | None = None
        """distdiag.hang.recorder.EngineReader, made on first use by the thread that snapshots (the sentinel)."""
        self.timing = False
        """True while a probe times something (the bandwidth loops): the sentinel then
        ticks slowly, since its store round trips would be timed too."""
        self.timing_since = 0.0

    def enter_phase(self, phase: str, probe_index: int = -1, probe_name: str = "") -> None:
        self.phase = phase
        self.phase_since = time.monotonic()
        if probe_index >= 0:
            if probe_index != self.probe_index:
                self.collectives_in_probe = 0
            self.probe_index = probe_index
            self.probe_name = probe_name

    def begin(self, op: str, tensor: object, group_name: str, detail: str = "") -> CollectiveRecord:
        """Record that the main thread enters a collective; pair with `end` in a finally.

        Cheap on purpose (the bandwidth probe times collectives through this): strings are
        built only when a snapshot is taken.
        """
        seq = self.seq[group_name] = self.seq[group_name] + 1
        self.collectives_in_probe += 1
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.endswith(_SKIP_FILES):
            frame = frame.f_back
        record = CollectiveRecord(
            op, group_name, seq, getattr(tensor, "shape", None), getattr(tensor, "dtype", None) if tensor is not None else None,
        ).in_probe(self.collectives_in_probe, detail, frame.f_code if frame is not None else None,
                   frame.f_lineno if frame is not None else 0)
        self.in_collective = record
        return record

    def end(self, record: CollectiveRecord) -> None:
        self.in_collective = None
        record.t1 = time.monotonic()
        self.recent.append(record)

    @contextmanager
    def timed(self) -> Iterator[None]:
        """A stretch the probe is timing: the sentinel keeps out of its way (see `timing`)."""
        self.timing_since = time.monotonic()
        self.timing = True
        try:
            yield
        finally:
            self.timing = False

    @contextmanager
    def collective(self, op: str, tensor: object, group_name: str, detail: str = "") -> Iterator[CollectiveRecord]:
        record = self.begin(op, tensor, group_name, detail)
        try:
            yield record
        finally:
            self.end(record)

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able picture of where the main thread is now."""
        now = time.monotonic()
        current = self.in_collective
        coll = current.to_dict(now) if current is not None else None
        snap = {
            "phase": self.phase,
            "phase_for_s": round(now - self.phase_since, 3),
            "probe_index": self.probe_index,
            "probe": self.probe_name,
            "in_collective": coll,
            "collectives_in_probe": self.collectives_in_probe,
            "recent": [r.to_dict() for r in list(self.recent)],
            "stack": main_thread_stack(),
        }
        engine = self.engine_view()
        if engine is not None:
            snap["engine"] = engine
        return snap

    def engine_view(self) -> dict[str, Any] | None:
        """Where torch's flight recorder says this rank is, per process group: it also sees the
        collectives torch issues itself (DCP's object collectives, FSDP's, a user hook's DDP)."""
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        if self._engine is None:
            from distdiag.hang.recorder import EngineReader

            self._engine = EngineReader()
        return self._engine.read(details=True, tail=16)
