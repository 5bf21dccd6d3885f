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
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Tracker", "main_thread_stack", "thread_stack", "describe_tensor"]


def describe_tensor(tensor: Any) -> dict[str, Any]:
    try:
        return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).replace("torch.", "")}
    except AttributeError:
        return {"shape": None, "dtype": type(tensor).__name__}


_SKIP_FILES = ("tracker.py", "comm.py", "contextlib.py")


def _call_site(skip_files: tuple[str, ...]) -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.endswith(skip_files):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


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
        self.in_collective: dict[str, Any] | None = None
        self.collectives_in_probe = 0
        self.seq: dict[str, int] = collections.defaultdict(int)
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=8)

    def enter_phase(self, phase: str, probe_index: int = -1, probe_name: str = "") -> None:
        self.phase = phase
        self.phase_since = time.monotonic()
        if probe_index >= 0:
            if probe_index != self.probe_index:
                self.collectives_in_probe = 0
            self.probe_index = probe_index
            self.probe_name = probe_name

    def begin(self, op: str, tensor: Any, group_name: str, detail: str = "") -> dict[str, Any]:
        """Record that the main thread enters a collective; pair with `end` in a finally."""
        self.seq[group_name] += 1
        self.collectives_in_probe += 1
        record = {
            "op": f"{op}({detail})" if detail else op,
            "group": group_name,
            "seq": self.seq[group_name],
            "index_in_probe": self.collectives_in_probe,
            **describe_tensor(tensor),
            "call_site": _call_site(_SKIP_FILES),
            "since": time.monotonic(),
        }
        self.in_collective = record
        return record

    def end(self, record: dict[str, Any]) -> None:
        self.in_collective = None
        done = dict(record)
        done["duration_s"] = time.monotonic() - done.pop("since")
        self.recent.append(done)

    @contextmanager
    def collective(self, op: str, tensor: Any, group_name: str, detail: str = "") -> Iterator[dict[str, Any]]:
        record = self.begin(op, tensor, group_name, detail)
        try:
            yield record
        finally:
            self.end(record)

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able picture of where the main thread is now."""
        now = time.monotonic()
        coll = self.in_collective
        if coll is not None:
            coll = {k: v for k, v in coll.items() if k != "since"}
            coll["for_s"] = round(now - self.in_collective["since"], 3) if self.in_collective else 0
        return {
            "phase": self.phase,
            "phase_for_s": round(now - self.phase_since, 3),
            "probe_index": self.probe_index,
            "probe": self.probe_name,
            "in_collective": coll,
            "collectives_in_probe": self.collectives_in_probe,
            "recent": list(self.recent),
            "stack": main_thread_stack(),
        }
