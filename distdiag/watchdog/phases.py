"""Declared phases shared between ranks, so that a rank waiting on a peer in one is not hung.

Each rank publishes its innermost phase (distdiag.watchdog.progress) under `phase/RANK` with
the wall-clock time its budget runs out, and keeps `phase_n`, the number of ranks in a phase,
so the common case (none) costs one store read. torch.compile's compilation becomes a phase
of its own through dynamo's callbacks, hooked once dynamo is imported.

A job that is still starting is not hung either (issue 24: healthy jobs were aborted on a
loaded machine): a rank whose training thread is importing modules (torch imports parts of
itself lazily, e.g. in DDP's constructor; 10 s and more on a busy CPU) publishes an
`import` phase, and until every rank's watchdog has checked in, a waiting rank is excused -
both within the startup budget (WatchdogConfig.startup_timeout).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import timedelta
from typing import Any

from distdiag.hang.recorder import loaded
from distdiag.runtime.exchange import BATCH, Exchange
from distdiag.runtime.keys import Keys
from distdiag.watchdog.progress import Progress

__all__ = ["PhaseBoard", "importing"]

log = logging.getLogger("distdiag.watchdog")


def importing(thread_ident: int) -> bool:
    """Whether that thread is executing an import (importlib's frames are on its stack)."""
    frame = sys._current_frames().get(thread_ident)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


class PhaseBoard:
    """This rank's side of the phases in the store: what it published, and the peers' read back."""

    def __init__(self, rank: int, world: int, progress: Progress) -> None:
        self.rank = rank
        self.world = world
        self.progress = progress
        self.published: tuple[Any, ...] = ()
        self.published_blocked = False
        self._compile_hooked = False
        self.import_since = 0.0
        self.started = time.monotonic()
        self._all_in = False

    def start(self, ex: Exchange) -> None:
        """No phase yet: peers read an empty one."""
        ex.store.set(Keys.phase(self.rank), "{}")
        self.started = time.monotonic()

    def publish(self, ex: Exchange, import_budget_s: float = 0.0, blocked: bool = False) -> None:
        """Post this rank's innermost phase when it changed (and count it in `phase_n`); with
        `import_budget_s`, an import in the training thread is a phase of that budget.

        `blocked`: this rank has waited inside a collective for a while, in its phase. A phase
        excuses the peers that wait for this rank's slow work (a long validation, a checkpoint
        write); a rank that waits itself is not working for them: a short rank that left the
        epoch for validation while its peers still train must not excuse their wait on it for
        the phase's whole budget. Its phase then excuses nobody (its own budget still holds)."""
        phases = list(self.progress.phases)
        current: tuple[Any, ...] = tuple(phases[-1]) if phases else ()
        if not current and import_budget_s > 0 and importing(self.progress.thread_ident):
            since = self.import_since or time.monotonic()
            self.import_since = since
            current = ("import", import_budget_s, since)
        elif not current:
            self.import_since = 0.0
        blocked = bool(current) and blocked
        if current == self.published and blocked == self.published_blocked:
            return
        self.published_blocked = blocked
        if current:
            name, budget, since = current
            until = time.time() + budget - (time.monotonic() - since)
            ex.store.set(Keys.phase(self.rank), json.dumps({"name": name, "until": until, "blocked": blocked}))
            if not self.published:
                ex.store.add(Keys.PHASE_COUNT, 1)
                ex.store.set(Keys.PHASE_LAST, str(self.rank))  # peers read this rank first
        else:
            ex.store.set(Keys.phase(self.rank), "{}")
            ex.store.add(Keys.PHASE_COUNT, -1)
        self.published = current

    def leave(self, ex: Exchange) -> None:
        """This rank is done: it no longer counts among the ranks in a phase."""
        if self.published:
            ex.store.add(Keys.PHASE_COUNT, -1)

    def peer_in_phase(self, ex: Exchange) -> str | None:
        """Which other rank is inside a declared phase that still has budget, if any.

        O(1) in the usual case (issue 21: each check read all N ranks' phases): the rank that
        entered a phase last is read first; only when it has left is every rank's read, in
        batches, stopping at the first one in a phase."""
        if int(ex.store.add(Keys.PHASE_COUNT, 0)) <= 0:
            return None
        last = ex.store.get(Keys.PHASE_LAST) if ex.store.check([Keys.PHASE_LAST]) else b""
        first = [int(last)] if last.isdigit() and int(last) < self.world else []
        for ranks in (first, *(range(s, min(s + BATCH, self.world)) for s in range(0, self.world, BATCH))):
            found = self._in_phase(ex, list(ranks))
            if found is not None:
                return found
        return None

    def _in_phase(self, ex: Exchange, ranks: list[int]) -> str | None:
        # a rank still starting has no phase key yet: a multi_get would wait for it
        ranks = ex.present(Keys.PHASE, [r for r in ranks if r != self.rank])
        if not ranks:
            return None
        values = ex.store.multi_get([Keys.phase(r) for r in ranks])
        now = time.time()
        for r, raw in zip(ranks, values, strict=True):
            ph = json.loads(raw) if raw else {}
            if ph.get("until", 0) > now and not ph.get("blocked"):
                return f"rank {r} in phase '{ph['name']}'"
        return None

    def peer_starting(self, ex: Exchange, budget_s: float) -> str | None:
        """A rank whose watchdog has not checked in yet (still importing torch or the script,
        before arming), while this rank's startup budget lasts; None once all have."""
        if self._all_in or time.monotonic() - self.started > budget_s:
            return None
        if ex.count(Keys.INFO) >= self.world:
            self._all_in = True
            return None
        posted = set(ex.present(Keys.INFO))  # once: it was read again for every rank (N^2)
        missing = [r for r in range(self.world) if r not in posted]
        return f"rank {missing[0]} still starting (its watchdog has not checked in)" if missing else None

    def hook_compile(self, compile_timeout: timedelta) -> None:
        """torch.compile's compilation is a phase with its own budget: ranks that wait for a
        peer that (re)compiles are not hung. Hooked once the training thread has finished
        importing dynamo: this runs on the watchdog's thread, which must never import (see
        distdiag.hang.recorder.loaded), so a dynamo still being imported is left for a later tick."""
        if self._compile_hooked:
            return
        dynamo, callback = loaded("torch._dynamo"), loaded("torch._dynamo.callback")
        if dynamo is None or callback is None:
            return
        self._compile_hooked = True
        try:
            callback_handler = callback.callback_handler
            budget = compile_timeout.total_seconds()
            progress = self.progress
            callback_handler.register_start_callback(lambda *_a: progress.enter_phase("compile", budget))
            callback_handler.register_end_callback(lambda *_a: progress.exit_phase("compile"))
            self._compile_callbacks = callback_handler
        except Exception as exc:  # noqa: BLE001 - an older torch: compiles count against the timeout
            log.debug("cannot hook torch.compile's callbacks: %s", exc)
