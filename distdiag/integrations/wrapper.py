"""The watchdog `python -m distdiag.watch` armed, as seen from the script it runs.

`distdiag.watch.armed()` is the documented way, but under `-m distdiag.watch` the wrapper runs as
`__main__`: a script that imports `distdiag.watch` gets a second copy of the module whose state
was never set, so `armed()` there returns None. The wrapper's own copy is reachable through the
init_process_group hook it installs (the hook carries `__distdiag_wrapped__`, and its globals are
the wrapper module's). Once the wrapper registers itself as `distdiag.watch`, the first lookup
finds it and the second is never reached.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["wrapper_watchdog", "mark_step"]


def wrapper_watchdog() -> Any:
    """The HangWatchdog `-m distdiag.watch` armed in this process, or None."""
    from distdiag import watch

    wd = watch.armed()
    if wd is not None:
        return wd
    dist = sys.modules.get("torch.distributed")
    hooked = getattr(dist, "init_process_group", None) if dist is not None else None
    if hooked is None or not hasattr(hooked, "__distdiag_wrapped__"):
        return None
    state = getattr(hooked, "__globals__", {}).get("_STATE")
    return state.get("wd") if isinstance(state, dict) else None


def mark_step(step: int) -> None:
    """A step mark on the wrapper's watchdog; nothing when the script runs without the wrapper.

    For scripts with their own loop (accelerate, plain torch) under `-m distdiag.watch`: ranks
    compare their collectives at each mark (a silent desync is found while the job runs), and a
    step longer than the timeout is a hang even with no collective waiting. Without marks the
    watchdog still counts optimizer steps and sees every collective through torch's recorder.
    """
    wd = wrapper_watchdog()
    if wd is not None:
        wd.step(step)
