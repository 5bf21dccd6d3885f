"""Let a process group's worker thread let go of our tensors before the process may end.

Why (torch 2.13, gloo, seen as a SIGABRT "terminate called without an active exception" on a
loaded machine): a gloo collective runs on one of the group's `pt_gloo_runloop` threads. The
caller's `wait()` returns when that thread marks the work completed; the thread drops its
reference to the work (and so to the tensors it holds) a moment later. A tensor Python has seen
keeps its Python object alive while C++ holds it, so that last drop takes the GIL. If the script
has ended in between, the interpreter is finalizing: the thread asking for the GIL is ended
with pthread_exit, whose unwinding through the work's noexcept destructor calls
std::terminate. The work's tensors can only be released safely while Python still runs.

`Tensor._use_count()` is the C++ reference count of the tensor: `use_counts` reads it before a
collective, `wait_released` waits (sleeping, so the GIL is free for that thread) until no more
than those references are left. Called after the LAST collective of ours before a process may
end (the monitor's final look; its latest look from an atexit handler), never on a hot path.

The work also holds the caller's thread-local state, which can hold a Python object (a torch
function mode active around the call; DDP's backward): the tensors are released a moment before
it, and nothing observable from Python says the work itself is gone. For a script's own last
collective (DDP's gradient all_reduce, say) `wait_gloo_idle` watches the workers instead: the
kernel says, per thread, whether it is asleep and how much CPU it has run (/proc/self/task/<tid>/
stat and schedstat). A worker still freeing a work is running, or waiting for the GIL, which this
thread gives up while it sleeps; one asleep with no CPU run over a stretch of that sleep has
nothing left to free (idle on its queue, or blocked in the network on a collective that never
ended: the wait does not hang on those). Run from an atexit handler (before Python finalizes),
registered by the watchdog when it arms (so under `distdiag watch` too) and by the monitor.
Linux only (elsewhere it returns at once).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch

__all__ = ["use_counts", "wait_released", "wait_gloo_idle", "gloo_workers", "idle_at_exit"]

RELEASE_WAIT_S = 2.0
"""At most this long for the worker thread to let go (it needs a moment of CPU and the GIL; on a
loaded node a few ms, rarely more). Past it the caller goes on, as it did before."""


def _count(t: torch.Tensor) -> int | None:
    fn = getattr(t, "_use_count", None)
    try:
        return int(fn()) if fn is not None else None
    except Exception:  # noqa: BLE001 - a tensor subclass or an older torch: nothing to wait for
        return None


def use_counts(tensors: Sequence[torch.Tensor]) -> list[int | None]:
    """The C++ reference counts of `tensors` now (None where torch does not tell)."""
    return [_count(t) for t in tensors]


def wait_released(
    tensors: Sequence[torch.Tensor], before: Sequence[int | None], timeout_s: float = RELEASE_WAIT_S
) -> bool:
    """Wait until each tensor is held by no more C++ references than `before` (from `use_counts`
    before the collective); True when they are, False when `timeout_s` passed first."""
    deadline = time.monotonic() + timeout_s
    pause = 0.0005
    while True:
        if all(b is None or (n := _count(t)) is None or n <= b for t, b in zip(tensors, before, strict=True)):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)  # releases the GIL: the worker thread needs it to drop the tensor
        pause = min(pause * 2, 0.02)


GLOO_WORKER = "pt_gloo_runloop"
"""The name torch gives each gloo process group's worker threads (c10::setThreadName)."""
GLOO_IDLE_WAIT_S = 1.0
"""At most this long for the workers to go idle: an exit delayed by a second at worst."""
GLOO_QUIET_S = 0.02
"""Idle = asleep with no CPU run for this long while this thread slept: four of Python's 5 ms
switch intervals, in which a worker waiting for the GIL would have had it."""
_TASKS = "/proc/self/task"


def gloo_workers() -> dict[str, tuple[str, int]]:
    """This process's gloo worker threads: tid -> (scheduler state letter, CPU run in ns).
    Empty where /proc does not tell (not Linux) or no gloo group was made."""
    out: dict[str, tuple[str, int]] = {}
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/comm") as f:
                if f.read().strip() != GLOO_WORKER:
                    continue
            with open(f"{_TASKS}/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"{_TASKS}/{tid}/schedstat") as f:
                ran = int(f.read().split()[0])
        except (OSError, IndexError, ValueError):  # the thread ended, or a kernel without schedstat
            continue
        out[tid] = (state, ran)
    return out


def wait_gloo_idle(timeout_s: float = GLOO_IDLE_WAIT_S, quiet_s: float = GLOO_QUIET_S) -> bool:
    """Sleep (the GIL free) until every gloo worker thread of this process has been asleep with
    no CPU run for `quiet_s`: none is still freeing a finished collective. True when they are
    (or there are none), False when `timeout_s` passed first; never raises."""
    try:
        last = gloo_workers()
        if not last:
            return True
        deadline = time.monotonic() + timeout_s
        quiet_since = time.monotonic()
        while True:
            time.sleep(0.002)
            now_seen = gloo_workers()
            now = time.monotonic()
            if now_seen != last or any(state not in ("S", "D") for state, _ in now_seen.values()):
                quiet_since, last = now, now_seen
            elif now - quiet_since >= quiet_s:
                return True
            if now >= deadline:
                return False
    except Exception:  # noqa: BLE001 - at exit: never in the way of the process ending
        return False


_REGISTERED: list[bool] = []


def idle_at_exit() -> None:
    """Have this process wait for its gloo workers to go idle when Python exits (an atexit
    handler, registered once per process): atexit runs before the interpreter finalizes, so a
    worker still freeing the script's last collective (DDP's, say) finishes while it can."""
    if not _REGISTERED:
        import atexit

        _REGISTERED.append(True)
        atexit.register(wait_gloo_idle)
