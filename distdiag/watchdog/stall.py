"""When one rank declares a hang by itself: no progress for too long while it waits.

Progress is the training thread's (step marks, optimizer steps, collectives our wrappers saw;
distdiag.watchdog.progress) or torch's own: a collective that completed on any group, per the
flight recorder (distdiag.hang.recorder), which also tells whether one is enqueued and not
completed, whoever issued it (DDP's reducer, FSDP, a compiled graph, NCCL). The limit is the
timeout, or the budget of the phase the rank is in. Long compute with no collective waiting is
never a hang by itself, and a peer inside a declared phase with budget left excuses the wait,
as does a peer still starting: importing, or not checked in yet (distdiag.watchdog.phases).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

from distdiag.hang.groupid import parse_label
from distdiag.runtime.exchange import BATCH, Exchange, poll_interval
from distdiag.runtime.keys import Keys
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
        self.pending_since = 0.0
        """When this rank was first seen with a collective enqueued and not completed (monotonic)."""
        self._engine_total = -1
        self._engine_warned = False
        self._published = (-1, 0.0)
        """(completed total, monotonic time) of the counts last published under eng/RANK."""
        self.c10d_wait: tuple[tuple[int, int], float] | None = None
        """(the training thread's innermost frame inside torch.distributed, since when): `note_c10d_frame`."""
        self._pending: dict[str, int] = {}
        """group -> the sequence number this rank's recorder shows enqueued and not completed."""

    @property
    def engine_pending(self) -> bool:
        """Whether torch's recorder shows a collective of this rank enqueued and not completed."""
        return bool(self._pending)

    def start(self, engine: Any) -> None:
        """Read torch's records through `engine` (an EngineReader) from now on."""
        self.engine = engine
        self.engine_progress = time.monotonic()

    def read_engine(self, ex: Exchange | None = None) -> None:
        """Progress and waiting from torch's own records (no Python wrapper involved); with `ex`,
        this rank's completed counts per group are published for its peers (`eng/RANK`) when
        they changed, at most every timeout/4: peers read them only after a timeout, and a job
        of thousands of ranks must not write to the store on every tick."""
        self.progress.poll_async()  # gloo's send/recv Work has no future: its completion is polled here
        if self.engine is None or not self.engine.available:
            return
        view = self.engine.read(details=False)
        if view["state"] != "ok":
            self._pending = {}
            if not self._engine_warned and self.progress.total > 0 and self.rank == 0:
                self._engine_warned = True
                log.warning("distdiag watchdog: %s", view.get("reason"))
            return
        total = self.engine.completed_total
        now = time.monotonic()
        if total != self._engine_total:
            self._engine_total = total
            self.engine_progress = now
        # at most every timeout/4, and never more than one request a rank a tick of the job's
        # poll budget (a short timeout at 16k ranks offered 50,000 sets a second)
        every = poll_interval(self.config.timeout_s / 4, self.phase_board.world)
        if ex is not None and total != self._published[0] and now - self._published[1] >= every:
            ex.store.set(Keys.engine(self.rank), json.dumps({g["group"]: g["completed"] for g in view["groups"]}))
            self._published = (total, now)
        pending = {g["group"]: g["enqueued"] for g in view["groups"] if g["enqueued"] > g["completed"]}
        if pending and not self._pending:
            self.pending_since = now
        self._pending = pending

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
        base = base_before_wait = max(base, self.engine_progress)
        waiting_since = self.waiting_since()
        if waiting_since is not None:
            # A wait counts from when it began: a rank that computed past the timeout and then
            # enters a collective its peers have not reached yet is not hung (they may be a
            # moment behind in the same compute); it is once it has waited the timeout.
            base = max(base, waiting_since)
        idle = now - base
        if idle <= limit:
            return None
        if waiting_since is not None and self.c10d_wait is None and self._recorder_lags(ex):
            # gloo marks a collective completed late (when its work is waited or freed): this
            # rank's recorder still shows one open that its peers completed. It is not waiting.
            waiting_since = None
            idle = now - max(base_before_wait, self.engine_progress)
            if idle <= limit:
                return None
        waiting = waiting_since is not None
        if not phases and not prog.explicit and not waiting:
            # Not waiting in any collective (torch's recorder and our wrappers agree) and no
            # step marks of the user's: long compute looks the same as a hang from inside the
            # rank. Ranks waiting for this one declare it, and the report names this rank.
            return None
        if not phases:
            board = self.phase_board
            peer = board.peer_in_phase(ex) or board.peer_starting(ex, self.config.startup_timeout.total_seconds())
            if peer is not None:
                self.excused = now  # waiting on a declared phase: not hung until its budget runs out
                return None
        return f"rank {self.rank} made no progress for {idle:.1f}s {what}"

    def blocked_in_collective(self, ex: Exchange) -> bool:
        """Whether the training thread waits inside a collective now (action='raise' cannot
        interrupt it there): a wrapper's record says so, or the recorder shows one open that no
        peer has completed and that was issued after the rank's last step began. gloo can leave
        a rank's last collective open in the recorder for seconds after it returned (seen here:
        completed 3 of 6 five seconds after the loop), on every rank at once too, so its open
        entry alone would call a rank blocked that is back in Python code."""
        if self.progress.current is not None:
            return True
        try:
            self.read_engine()  # the counts as they are now, not as of the last tick
            # this rank's own step marks first: the peers' counts cost store reads
            return self.engine_pending and not self._stepped_since_pending() and not self._recorder_lags(ex)
        except Exception as exc:  # noqa: BLE001 - the store failed: the recorder's reading alone
            log.debug("could not compare the recorder's open collective with the peers': %s", exc)
            return self.engine_pending

    def note_c10d_frame(self) -> None:
        """Once a tick: whether the training thread is blocked inside one call of torch.distributed
        (its innermost frame in distributed_c10d.py, the same frame at the same instruction as
        at the last tick: a gloo collective's work.wait(), a barrier, a store wait). It is the
        direct sight of a wait where torch's recorder lags or pairs by order: gloo shows a
        collective completed whose partner was another op (seen: Lightning's per-step broadcast
        paired with a short rank's metric barrier), and the wrappers may be off. Progress still
        resets the clock (`overdue` counts from the latest progress)."""
        frame = sys._current_frames().get(self.progress.thread_ident)
        here = (id(frame), frame.f_lasti) if frame is not None and frame.f_code.co_filename.endswith(_C10D_FILE) else None
        if here is None:
            self.c10d_wait = None
        elif self.c10d_wait is None or self.c10d_wait[0] != here:
            self.c10d_wait = (here, time.monotonic())

    def _stepped_since_pending(self) -> bool:
        """True when this rank began a step (a mark, or an optimizer step) after every collective
        the recorder shows open was issued: a rank cannot begin a step while blocked in an
        earlier collective, so those are done (or async, not waited on). False when unsure."""
        walls = list(self.progress.step_walls)
        if not walls or self.engine is None:
            return False
        view = self.engine.read(details=True)
        now_ns = time.time_ns()
        ages = [g["pending"].get("for_s") for g in view.get("groups") or [] if g.get("pending")]
        if not ages or any(not isinstance(a, int | float) for a in ages):
            return False
        # Issued at now - age at the latest (the age is rounded to 1 ms: keep 2 ms clear of it).
        issued_ns = max(now_ns - int(a * 1e9) for a in ages)
        return int(walls[-1][0]) > issued_ns + 2_000_000

    def _recorder_lags(self, ex: Exchange) -> bool:
        """True when the only wait is the recorder's and, on every group it shows open, another
        rank has already completed that collective (a collective one rank completed cannot be
        waiting for this one). One peer's counts are enough: on a loaded machine a peer busy
        importing may not have published yet. False when unsure: no peer published, a wrapper's wait.

        Only members of the open groups are read, at most BATCH of them (issue 21: every rank
        reading all N-1 peers' counts was N^2 reads at a hang of the whole job): a collective
        that any member completed was entered by all, so when it lags, most members show it."""
        prog = self.progress
        if prog.current is not None or prog.pending_async or not self._pending:
            return False
        world = self.phase_board.world
        peers: set[int] = set()
        for group in self._pending:
            peers.update(r for r in group_members(group, world) if r != self.rank)
        sample = _spread(sorted(peers), BATCH)
        counts = list(ex.collect(Keys.ENGINE, sample).values()) if sample else []
        if not counts:
            return False
        return all(any(p.get(group, -1) >= seq for p in counts) for group, seq in self._pending.items())

    def waiting_since(self) -> float | None:
        """When this rank began waiting in a collective (ours seen by a wrapper, or torch's per
        the recorder), or None when it waits in none."""
        prog = self.progress
        starts = []
        current = prog.current
        if current is not None:
            starts.append(current.t0)
        if prog.pending_async:
            starts.extend(r.t0 for r in list(prog.pending_async.values()))
        if self.engine_pending:
            starts.append(self.pending_since)
        if self.c10d_wait is not None:
            starts.append(self.c10d_wait[1])
        return min(starts) if starts else None


_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")


def group_members(label: str, world: int) -> list[int]:
    """The global ranks of a recorder group label ('ranks[0,8,16]', 'world'); every rank when
    the label does not list them ('group NAME'): any of them may be a member whose count says
    the collective completed."""
    known = parse_label(label).ranks(world)
    return known if known is not None else list(range(world))


def _spread(ranks: list[int], most: int) -> list[int]:
    """At most `most` of `ranks`, evenly spread (hosts and stages alike)."""
    if len(ranks) <= most:
        return ranks
    step = len(ranks) / most
    return [ranks[int(i * step)] for i in range(most)]

