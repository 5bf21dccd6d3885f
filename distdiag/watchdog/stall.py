"""When one rank declares a hang by itself: no progress for too long while it waits.

Progress is the training thread's (step marks, optimizer steps, collectives our wrappers saw;
distdiag.watchdog.progress) or torch's own: a collective that completed on any group, per the
flight recorder (distdiag.hang.recorder), which also tells whether one is enqueued and not
completed, whoever issued it (DDP's reducer, FSDP, a compiled graph, NCCL). The limit is the
timeout, or the budget of the phase the rank is in. Long compute with no collective waiting is
never a hang by itself, and a peer inside a declared phase with budget left excuses the wait
(distdiag.watchdog.phases).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from distdiag.runtime.exchange import Exchange
from distdiag.watchdog.config import WatchdogConfig
from distdiag.watchdog.phases import PhaseBoard
from distdiag.watchdog.progress import Progress

__all__ = ["StallCheck"]

log = logging.getLogger("distdiag.watchdog")


class StallCheck:
    """One rank's clock: its last progress (its own and the recorder's), and when it is overdue."""

    def __init__(self, rank: int, progress: Progress, config: WatchdogConfig, phase_board: PhaseBoard) -> None:
        self.rank = rank
        self.progress = progress
        self.config = config
        self.phase_board = phase_board
        self.excused = 0.0
        self.engine: Any = None
        self.engine_progress = 0.0
        """When a collective last completed on any group, per the recorder (monotonic)."""
        self.engine_pending = False
        self._engine_total = -1
        self._engine_warned = False

    def start(self, engine: Any) -> None:
        """Read torch's records through `engine` (an EngineReader) from now on."""
        self.engine = engine
        self.engine_progress = time.monotonic()

    def read_engine(self) -> None:
        """Progress and waiting from torch's own records (no Python wrapper involved)."""
        if self.engine is None or not self.engine.available:
            return
        view = self.engine.read(details=False)
        if view["state"] != "ok":
            self.engine_pending = False
            if not self._engine_warned and self.progress.total > 0 and self.rank == 0:
                self._engine_warned = True
                log.warning("distdiag watchdog: %s", view.get("reason"))
            return
        total = self.engine.completed_total
        if total != self._engine_total:
            self._engine_total = total
            self.engine_progress = time.monotonic()
        self.engine_pending = any(g["enqueued"] > g["completed"] for g in view["groups"])

    def overdue(self, ex: Exchange, reported_at: float) -> str | None:
        """What to declare as the timeout when this rank waited too long without progress, else None
        (`reported_at`: when the last report-only event was acted on, 0 if none)."""
        prog = self.progress
        now = time.monotonic()
        if reported_at and prog.last_progress <= reported_at:
            return None  # report-only: wait for new progress before watching again
        phases = list(prog.phases)
        if phases:
            name, limit, since = phases[-1]
            base = max(prog.last_progress, since, self.excused)
            what = f"in phase '{name}' (budget {limit:g}s)"
        else:
            limit, base = self.config.timeout_s, max(prog.last_progress, self.excused)
            what = f"(timeout {limit:g}s)"
        base = max(base, self.engine_progress)
        idle = now - base
        if idle <= limit:
            return None
        waiting = prog.current is not None or bool(prog.pending_async) or self.engine_pending
        if not phases and not prog.explicit and not waiting:
            # Not waiting in any collective (torch's recorder and our wrappers agree) and no
            # step marks of the user's: long compute looks the same as a hang from inside the
            # rank. Ranks waiting for this one declare it, and the report names this rank.
            return None
        if not phases:
            peer = self.phase_board.peer_in_phase(ex)
            if peer is not None:
                self.excused = now  # waiting on a declared phase: not hung until its budget runs out
                return None
        return f"rank {self.rank} made no progress for {idle:.1f}s {what}"
