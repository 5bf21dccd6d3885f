"""Ranks the writer of a broken run never heard from because they had not checked in: what
their phase notes say.

Each rank notes what it is doing from its first line, before it imports torch
(distdiag.launcher.ranks.note_phase: in the launcher's folder under `distdiag check`, else in
its torchrun agent's folder on this host). A rank lost there left nothing in the store, but
its note gives its pid (gone, or still alive), the stop signal it got while importing (noted,
not obeyed: distdiag/runtime/early.py) and, when a fatal signal killed it, the stack
faulthandler wrote (distdiag/runtime/deathnote.py). A rank that got the same stop signal as
the others while still starting is part of a cancellation, not a lost rank.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

from distdiag.hang.records import Silence, SilentReason
from distdiag.launcher.ranks import noted_rank
from distdiag.runtime import deathnote
from distdiag.runtime.incident import process_state

if TYPE_CHECKING:
    from distdiag.runtime.sentinel import Sentinel

__all__ = ["with_last_notes", "signalled_while_importing"]


def with_last_notes(lost: dict[int, Silence], checked_in: dict[int, Any]) -> tuple[dict[int, Silence], set[int]]:
    """(`lost`, each rank that never checked in told with its note; the ranks among them that
    were still starting when a stop signal reached them). A rank whose noted process is gone is
    GONE, with its fatal signal when faulthandler caught one (SIGKILL leaves no trace)."""
    signalled: set[int] = set()
    for r in list(lost):
        note = noted_rank(r) if r not in checked_in else None
        if note is None:
            continue
        pid, got = note["pid"], note.get("signal")
        said = f"its last word was '{note['phase']}'" + (f", where it received {got}" if got else "")
        if got:
            signalled.add(r)
        state = process_state(pid)
        if state == "gone":
            death = deathnote.read(pid)
            how = death.text() if death is not None else "killed or exited"
            lost[r] = Silence(SilentReason.GONE, f"its process (pid {pid}) is gone: {how}, before it checked in ({said})", death)
        else:
            lost[r] = lost[r].noted(f"; {said} (pid {pid}, now {state})")
    return lost, signalled


def signalled_while_importing(sentinel: Sentinel, rank: int) -> bool:
    """A SIGTERM or SIGINT noted while this rank imported torch (distdiag/runtime/early.py):
    True once the sentinel is asked to end the run for it (the caller then waits for it, before
    checking in). The sentinel reads the same signal from its pipe, but might act on it only
    once a fast run had already passed."""
    from distdiag.runtime.early import deferred

    got = deferred()
    if not got:
        return False
    name = signal.Signals(got[0]).name
    what = "SIGINT (Ctrl-C)" if name == "SIGINT" else name
    sentinel.trigger("terminated", f"rank {rank} received {what} while it was importing torch and the check "
                     "(from the launcher: another worker failed, or the job was cancelled)")
    return True
