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

Limits: the work also holds the caller's thread-local state, which can hold a Python object (a
torch function mode active around the call; DDP's backward): the tensors are released a moment
before it. Nothing observable from Python says the work itself is gone, so a script's own last
collective (DDP's gradient all_reduce, say) cannot be waited on from here (docs/facts.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

__all__ = ["use_counts", "wait_released"]

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
