"""The watchdog thread of one rank: notice a hang or a desync, agree on it, report, act.

Every tick (a fraction of the timeout) the thread
  - reads torch's flight recorder (distdiag.hang.recorder, ~0.1 ms): a completed collective on any
    group is progress, an enqueued one not completed means this rank waits in a collective -
    whoever issued it (DDP's reducer, FSDP, a compiled graph, NCCL);
  - publishes this rank's declared phase (so peers waiting on it are not called hung;
    distdiag.watchdog.phases);
  - compares this rank's collective digests at step marks with the group's lowest rank
    (through the store: the lowest rank posts its last marks, the others read them;
    distdiag.watchdog.marks);
  - looks for a job-wide event (`event/N`) another rank declared;
  - declares one itself when this rank made no progress for the timeout (or its phase's
    budget) while it waits in a collective (or while it marks steps itself), unless a peer
    is inside a declared phase that still has budget. Long compute with no collective
    waiting is never a hang by itself (optimizer steps alone do not make it one;
    distdiag.watchdog.stall).
A rank whose training code raises declares a `raised` event at once (the exception leads
the report when it stranded the others), then its exception goes on.
On an event every rank posts a snapshot; one claims the writer role and writes the report
(distdiag.watchdog.writer); then each rank acts: abort (os._exit after flushing; the writer
also ends same-host ranks that are stopped or silent, by pid), raise (HangDetected in the
training thread when it runs Python code; a rank blocked in a collective cannot be
interrupted on gloo and is aborted), or report (carry on; re-arm after new progress).
The thread never takes a signal handler and never blocks the training thread.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any, cast

from distdiag.errors import HangDetected, print_line
from distdiag.hang.records import EngineView, EventKind, IncidentEvent, RankSnapshot, Verdict
from distdiag.report.model import RankInfo
from distdiag.runtime.exchange import Exchange, poll_interval
from distdiag.runtime.incident import (
    WRITER_STALL_S,
    Incident,
    Seat,
    kill_pid,
    kill_stopped_local,
    post_snapshot,
    process_state,
)
from distdiag.runtime.keys import IncidentKeys, Keys
from distdiag.runtime.nodes import aggregate_node, node_members
from distdiag.runtime.sentinel import flush_and_exit
from distdiag.watchdog.config import EXIT_WATCHDOG, WatchdogConfig
from distdiag.watchdog.marks import MarkComparer
from distdiag.watchdog.phases import PhaseBoard, importing
from distdiag.watchdog.progress import Progress
from distdiag.watchdog.stall import StallCheck
from distdiag.watchdog.writer import REPORT_NAME, gather_and_write, publish_outcome

__all__ = ["Watcher", "RaisedHang"]

log = logging.getLogger("distdiag.watchdog")

VERDICT_STALL_S = WRITER_STALL_S
"""How long a non-writer waits for the writer's progress to move before acting on its own
(distdiag/runtime/incident.py: the wait follows the writer, not a fixed clock)."""
RECONNECT_AFTER = 5
"""Failed ticks in a row after which the watchdog opens a new client of the job's store."""
GIVE_UP_AFTER = 40
"""Failed ticks in a row (new clients included) after which the watchdog says it is off."""
PEERS_EXIT_WAIT_S = 3.0
"""After the report, how long the writer lets same-host peers leave before SIGKILLing them."""
LAUNCHER_SIGTERM_WAIT_S = 1.0
"""How long a peer_error waits for the launcher's SIGTERM when the wrapper took it (torchrun
sends it within its monitor interval, 0.1 s by default) before it is declared by itself."""

_raise_message = ["hang detected by distdiag's watchdog"]


class RaisedHang(HangDetected):
    """What the training thread sees in action='raise' (the message names the report)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(args or (_raise_message[0],)))


BLOCKED_IN_PHASE_S = 2.0
"""How long a rank in a phase waits inside a collective before its phase stops excusing peers
(a validation's metric syncs come and go in milliseconds)."""


class Watcher(threading.Thread):
    def __init__(
        self,
        *,
        progress: Progress,
        config: WatchdogConfig,
        info: Any,
        store_factory: Callable[[], Any],
        extra_config: dict[str, Any],
    ) -> None:
        super().__init__(name="distdiag-watchdog", daemon=True)
        self.progress = progress
        self.config = config
        self.info = info
        self.rank = info.rank
        self.world = info.world_size
        self.store_factory = store_factory
        self.extra_config = extra_config
        self.stopping = threading.Event()
        self.ready = threading.Event()
        self.error: dict[str, Any] | None = None
        self.handled = 0
        self.reported_at = 0.0
        self.desync_reported = False
        self.started = time.monotonic()
        self.ex: Exchange | None = None
        self.phase_board = PhaseBoard(self.rank, self.world, progress)
        self.mark_comparer = MarkComparer(self.rank, self.world)
        self.stall = StallCheck(self.rank, progress, config, self.phase_board)
        self._request: tuple[str, Any] | None = None
        self.acted = threading.Event()
        self.in_incident = threading.Event()
        """Set while this thread handles an event (snapshot, report or verdict, acting)."""
        self.engine: Any = None
        self.term: Any = None
        """The wrapper's TermWatch (distdiag/watchdog/sigterm.py) when this process took SIGTERM."""
        self.last_excuse: str | None = None
        """Why the last event handled was no hang (None: it was reported, or none was handled)."""
        self.terminated_handled = False
        self.peer_error_at: float | None = None
        """A `terminated` event was handled: this rank's own SIGTERM must not declare another
        (by then the peers that left after the first are gone, and would be blamed)."""

    def request(self, kind: str, detail: Any) -> None:
        """From the training thread: declare an event at the next tick (e.g. a peer died)."""
        self._request = (kind, detail)

    # -- lifecycle -----------------------------------------------------------------------
    def finish(self, error: dict[str, Any] | None, timeout: float = 3.0) -> None:
        """From the training thread: stop, post the final state; never wait longer than timeout."""
        self.error = error
        self.stopping.set()
        self.join(timeout)
        if self.is_alive():
            log.warning("the watchdog thread did not stop within %.0fs (store unreachable?); leaving it behind", timeout)

    def run(self) -> None:
        try:
            self.ex = Exchange(self.store_factory(), self.rank, self.world)
            info = self.info
            self.ex.post(Keys.INFO, RankInfo(self.rank, info.host, info.node, info.local_rank, "cpu", os.getpid()).to_dict())
            self.phase_board.start(self.ex)
        except Exception as exc:  # noqa: BLE001 - without a store the watchdog cannot report: say so, stay out of the way
            log.warning("rank %d: the watchdog cannot reach the job's store (%s); it is off", self.rank, exc)
            self.ready.set()
            return
        from distdiag.hang.recorder import EngineReader

        self.engine = EngineReader()
        self.stall.start(self.engine)
        self.ready.set()
        failures = 0
        poll = poll_interval(self.config.poll_s, self.world)  # one store request a tick: 0.66 s at 16k ranks
        while not self.stopping.wait(poll):
            try:
                self._tick()
                failures = 0
            except Exception as exc:  # noqa: BLE001 - a store hiccup must not end the job
                failures += 1
                log.debug("watchdog tick failed: %s", exc)
                if failures % RECONNECT_AFTER == 0:
                    self._reconnect()
                if failures >= GIVE_UP_AFTER:
                    print_line(f"distdiag[rank {self.rank}]: the watchdog lost the job's store ({type(exc).__name__}: "
                               f"{exc}) and could not reconnect; it is off, hangs on this rank go unreported")
                    return
        self._post_final()

    def _post_final(self) -> None:
        assert self.ex is not None
        try:
            snap = RankSnapshot.from_dict(self.progress.snapshot(self.config.history, finished=True))
            snap.rank, snap.host, snap.pid = self.rank, self.info.host, os.getpid()
            if self.engine is not None:
                # How far this rank got on each group: a rank that left while the others went
                # on (uneven data) is told apart by these counts after the fact.
                # Without wrappers its recorded collectives with their call sites are its history
                # (a rank that skipped one and ran out early is located by them).
                view = self.engine.read(details=False, tail=0 if self.config.wrap else 32, sites=True)
                snap.engine = EngineView.from_dict(view) if isinstance(view, dict) else None
            if self.error:
                self.ex.post(Keys.ERROR, self.error)
            post_snapshot(self.ex, Keys.FINAL, snap)
            self.phase_board.leave(self.ex)
        except Exception as exc:  # noqa: BLE001 - leaving anyway
            log.debug("could not post the final state: %s", exc)

    # -- one tick ------------------------------------------------------------------------
    def _tick(self) -> None:
        assert self.ex is not None
        self.stall.read_engine(self.ex)
        self.stall.note_c10d_frame()
        if not self.config.wrap and self.engine is not None:
            # Without wrappers, call sites come from the recorder's stacks: pay their one-time
            # symbolization now, on a thread of its own, not when a snapshot is due.
            self.engine.warm_sites()
        self.phase_board.hook_compile(self.config.compile_timeout)
        self.phase_board.publish(self.ex, self.config.startup_timeout.total_seconds(), blocked=_blocked_in_phase(self))
        if self.config.compare_steps and not self.desync_reported:
            self._compare_marks()
        if self.ex.store.check([Keys.event(self.handled + 1)]):
            self._handle(self.handled + 1)
            return
        if self.term is not None and self.term.received.is_set():
            self._on_sigterm()
            return
        if self._request is not None:
            kind, detail = self._request
            if _awaiting_launcher(self, kind):
                return
            self._request = None
            if not self.terminated_handled:  # after it, a peer's broken connection is its consequence
                self._declare(kind, detail)
            return
        self._check_local()

    def _check_local(self) -> None:
        assert self.ex is not None
        detail = self.stall.overdue(self.ex, self.reported_at)
        if detail is not None:
            self._declare(EventKind.TIMEOUT, detail)

    # -- digests at step marks -------------------------------------------------------------
    def _compare_marks(self) -> None:
        assert self.ex is not None
        every = poll_interval(self.config.poll_s, 2 * self.world)  # a read of a peer's marks is 2 requests
        desync = self.mark_comparer.compare(self.ex, self.progress, every=every)
        if desync is not None:
            self.desync_reported = True
            self._declare(EventKind.DESYNC, desync)

    # -- events ------------------------------------------------------------------------------
    def _reconnect(self) -> None:
        """A new client of the job's store (a failed call can leave the old one broken)."""
        try:
            self.ex = Exchange(self.store_factory(), self.rank, self.world)
        except Exception as exc:  # noqa: BLE001 - tried again after the next failures
            log.debug("watchdog could not reconnect to the job's store: %s", exc)

    def _declare(self, kind: EventKind | str, detail: Any) -> None:
        assert self.ex is not None
        event = IncidentEvent.from_dict({"kind": kind, "detail": detail, "rank": self.rank})
        if event.kind in (EventKind.RAISED, EventKind.PEER_ERROR) and isinstance(detail, dict):
            # The exception first, so the writer has it whoever claims the role.
            self.ex.post(Keys.ERROR, detail)
            event.detail = f"rank {self.rank} raised {detail.get('type')}: {detail.get('message')}"
        epoch = self.handled + 1
        _incident(self, epoch).declare(event)
        self._handle(epoch)

    def _snapshot(self, event: IncidentEvent) -> RankSnapshot:
        snap = RankSnapshot.from_dict(self.progress.snapshot(self.config.history))
        snap.rank, snap.host, snap.pid, snap.event = self.rank, self.info.host, os.getpid(), event
        # importing within the startup budget (an import stuck longer is a hang like any other)
        _note_waiting(self, snap)
        if self.engine is not None:
            # Call sites from the recorder's stacks: wait a little for their one-time warm-up (a
            # hang in the job's first seconds), well within the writer's snapshot grace.
            wait_s = 0.0 if self.config.wrap else min(1.0, self.config.snapshot_grace.total_seconds() / 2)
            view = self.engine.read(details=True, tail=16 if self.config.wrap else 32, sites=True, wait_s=wait_s)
            snap.engine = EngineView.from_dict(view) if isinstance(view, dict) else None
        return snap

    def _handle(self, epoch: int) -> None:
        self.in_incident.set()
        try:
            self._handle_event(epoch)
        finally:
            self.in_incident.clear()

    def _handle_event(self, epoch: int) -> None:
        assert self.ex is not None
        incident = _incident(self, epoch)
        event = incident.declared()
        if event.kind is EventKind.DESYNC:
            self.desync_reported = True
        if event.kind in (EventKind.TIMEOUT, EventKind.RAISED):
            _post_own_error(self)  # another kind's analysis would not read it: declared after
        incident.post_snapshot(self._snapshot(event))
        lost: Mapping[int, str] = {}
        writer = incident.claim_writer()
        if writer:
            excuse, lost = self._write(incident, event)
        else:
            _aggregate_node(self, incident)
            excuse = self._await(incident, event)
        self.ex = incident.ex  # a new client, if the writer had to reconnect
        self.handled = epoch
        self.last_excuse = excuse
        self.terminated_handled = self.terminated_handled or event.kind is EventKind.TERMINATED
        self.acted.set()
        if event.kind is EventKind.TERMINATED and self.term is not None and self.term.received.is_set():
            return  # this rank leaves as SIGTERM asks (_on_sigterm), whatever the action
        if excuse:
            self.reported_at = time.monotonic()  # as after a report-only event: watch again after new progress
            return
        self._act(event, writer, lost)

    def _write(self, incident: Incident, event: IncidentEvent) -> tuple[str | None, Mapping[int, str]]:
        """This rank writes the report and publishes the verdict (first) and the report."""
        report, lost, excuse = None, cast("Mapping[int, str]", {}), None
        try:
            report, lost, excuse = gather_and_write(
                incident, event=event, host=self.info.host, timeout_s=self.config.timeout_s,
                grace_s=self.config.snapshot_grace.total_seconds(), dump_dir=self.config.dump_dir,
                config=self.extra_config, started=self.started, own_snapshot=lambda: self._snapshot(event),
            )
        except Exception as exc:  # noqa: BLE001 - still act on the hang
            print_line(f"distdiag[rank {self.rank}]: failed to write the hang report: {exc}")
            traceback.print_exc()
        publish_outcome(incident, report, excuse=excuse, dump_dir=self.config.dump_dir)
        if excuse and event.kind is not EventKind.TERMINATED:
            print_line(f"distdiag[rank {self.rank}]: watchdog: no hang after all: {excuse}; watching on")
        return excuse, lost

    def _await(self, incident: Incident, event: IncidentEvent) -> str | None:
        """Wait for the verdict while the writer moves (answering its request to re-read);
        keep this host's copy of the report; the verdict's excuse, if any."""
        answered: list[bool] = []

        def reread() -> bool:
            # The writer asks again when this rank's snapshot contradicts itself (see
            # writer.inconsistent_ranks): re-read once, keeping the snapshot count as it is.
            if not answered and incident.ex.store.check([incident.keys.again(self.rank)]):
                answered.append(True)
                incident.repost_snapshot(self._snapshot(event))
            return False

        verdict, why = incident.wait_verdict(VERDICT_STALL_S, stop=reread)
        if verdict is None:
            print_line(f"distdiag[rank {self.rank}]: watchdog: no verdict came: {why}; acting on the event alone")
            return None
        if not verdict.excused:
            _keep_copy(self, incident, verdict)
        return verdict.excused

    def _on_sigterm(self) -> None:
        """The launcher is ending this rank (a peer died, or the job was cancelled): a report
        naming a rank that left first, unless one was written already; then leave (exit 3
        after a report, 143 as SIGTERM would have otherwise). See distdiag/watchdog/sigterm.py."""
        from distdiag.watchdog.sigterm import EXIT_SIGTERM

        if not self.terminated_handled and not (self.handled and not self.last_excuse):
            self._declare(EventKind.TERMINATED, f"rank {self.rank} received SIGTERM from the launcher (another worker "
                          "failed, or the job was cancelled)")
        if self.handled and not self.last_excuse:
            path = os.path.join(self.config.dump_dir, REPORT_NAME)
            print_line(f"distdiag[rank {self.rank}]: ended by SIGTERM after the report (exit {EXIT_WATCHDOG}); report: {path}")
            flush_and_exit(EXIT_WATCHDOG)
        flush_and_exit(EXIT_SIGTERM)

    # -- acting ----------------------------------------------------------------------------
    def _act(self, event: IncidentEvent, writer: bool, lost: Mapping[int, str]) -> None:
        action = self.config.action
        path = os.path.join(self.config.dump_dir, REPORT_NAME)
        if event.kind is EventKind.RAISED and event.rank == self.rank:
            return  # this rank's own exception goes on (the training thread re-raises it)
        if action == "report":
            self.reported_at = time.monotonic()
            return
        if action == "raise":
            # Blocked in a collective: the wrappers' record says so, or (without wrappers) the
            # recorder's collective enqueued and completed by no peer (gloo marks completion
            # late: the rank may be back in Python code, where HangDetected reaches it).
            cur = self.progress.current
            assert self.ex is not None
            if self.stall.blocked_in_collective(self.ex):
                what = f"{cur.op} #{cur.seq}" if cur is not None else "a collective (torch's flight recorder)"
                print(
                    f"distdiag[rank {self.rank}]: blocked inside {what}; "
                    "a rank waiting in a gloo collective cannot be interrupted, so the watchdog ends the process",
                    file=sys.stderr,
                )
            elif _raise_in_training_thread(self, event, path):
                return
        if writer:
            assert self.ex is not None
            end_local_peers(self.ex, lost, self.info.host, abort=self.config.action == "abort")
        print_line(f"distdiag[rank {self.rank}]: watchdog ending the process (exit {EXIT_WATCHDOG}); report: {path}")
        flush_and_exit(EXIT_WATCHDOG)


def end_local_peers(ex: Exchange, lost: Mapping[int, str], host: str, *, abort: bool) -> None:
    """Same-host ranks that cannot leave by themselves (stopped, silent) are killed by pid; with
    `abort`, every same-host peer still there after PEERS_EXIT_WAIT_S too."""
    try:
        infos = {r: RankInfo.from_dict(v) for r, v in ex.collect(Keys.INFO).items()}
    except Exception:  # noqa: BLE001 - nothing to end then
        return
    kill_stopped_local(lost, infos, host)
    local = {r: i.pid for r, i in infos.items() if i.host == host and i.pid != os.getpid() and i.pid > 0}
    if not abort:
        return  # with action "raise", peers may be saving a checkpoint after HangDetected
    end = time.monotonic() + PEERS_EXIT_WAIT_S
    while time.monotonic() < end and any(process_state(p) not in ("gone",) for p in local.values()):
        time.sleep(0.05)
    for pid in local.values():
        if process_state(pid) != "gone":
            kill_pid(pid)


def _raise_in_training_thread(watcher: Watcher, event: IncidentEvent, path: str) -> bool:
    """True once HangDetected was delivered and the training thread moved on."""
    kind = "desync" if event.kind is EventKind.DESYNC else "hang"
    _raise_message[0] = f"{kind} detected by distdiag's watchdog on rank {event.rank}; report: {path}"
    before = watcher.progress.last_progress
    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(watcher.progress.thread_ident), ctypes.py_object(RaisedHang)
    )
    if done != 1:
        return False
    wait_s = max(5.0, watcher.config.timeout_s)
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        if watcher.stopping.is_set() or watcher.progress.last_progress != before:
            watcher.reported_at = time.monotonic()
            return True
        time.sleep(0.05)
    # Said, so that an exit 3 under action='raise' tells which of its two causes it had.
    print_line(f"distdiag[rank {watcher.rank}]: HangDetected did not reach the training thread within {wait_s:g}s "
               "(it runs no Python code: blocked in a call of C code)")
    return False


def _aggregate_node(watcher: Watcher, incident: Incident) -> None:
    """Local rank 0 posts its node's snapshots as one value for the writer (distdiag/runtime/nodes.py)."""
    info = watcher.info
    if info.local_rank != 0 or getattr(info, "local_world_size", 1) < 2:
        return
    # Its node's ranks are those after it (torchrun numbers a node's ranks in a row): their rows
    # say which are on this node, without reading the whole rank table.
    candidates = list(range(watcher.rank, min(watcher.rank + info.local_world_size, watcher.world)))
    try:
        infos = {r: RankInfo.from_dict(v) for r, v in incident.ex.collect(Keys.INFO, candidates).items()}
    except Exception as exc:  # noqa: BLE001 - the writer reads this node's snapshots one by one
        log.debug("could not read this node's rank rows: %s", exc)
        return
    aggregate_node(incident, node_members(infos, watcher.rank))


def _note_waiting(watcher: Watcher, snap: RankSnapshot) -> None:
    """Whether the rank is still importing within the startup budget (an import stuck longer is
    a hang like any other), and whether it waits inside a collective in its phase."""
    since = watcher.phase_board.import_since
    budget = watcher.config.startup_timeout.total_seconds()
    snap.importing = importing(watcher.progress.thread_ident) and (not since or time.monotonic() - since <= budget)
    snap.present.add("importing")
    if _blocked_in_phase(watcher):
        snap.extra["blocked_in_phase"] = True


def _blocked_in_phase(watcher: Watcher) -> bool:
    """In a declared phase and waiting inside a collective for BLOCKED_IN_PHASE_S or more: its
    phase no longer excuses the peers (distdiag.watchdog.phases.PhaseBoard.publish)."""
    if not watcher.progress.phases:
        return False
    now = time.monotonic()
    wait = watcher.stall.c10d_wait
    current = watcher.progress.current  # a wrapped collective it is inside (no store read: this runs each tick)
    return ((wait is not None and now - wait[1] >= BLOCKED_IN_PHASE_S)
            or (current is not None and now - current.t0 >= BLOCKED_IN_PHASE_S))


def _post_own_error(watcher: Watcher) -> None:
    """This rank raised too, and a peer's event came first (an error raised on every rank at
    once): its exception goes into this incident, before its snapshot, so the report names every
    rank that raised; the request is then answered by this incident."""
    request = watcher._request
    # a broken connection (peer_error) is left to its own path: the launcher may yet say the
    # peer exited by itself, which is no hang to report
    if request is not None and request[0] == "raised" and isinstance(request[1], dict):
        assert watcher.ex is not None
        watcher.ex.post(Keys.ERROR, request[1])
        watcher._request = None


def _incident(watcher: Watcher, epoch: int) -> Incident:
    """The watchdog's event #epoch as this rank takes part in it."""
    assert watcher.ex is not None
    return Incident(watcher.ex, IncidentKeys(epoch), watcher.world, watcher.store_factory, Seat.of(watcher.info))


def _keep_copy(watcher: Watcher, incident: Incident, verdict: Verdict) -> None:
    """Local rank 0 of every other node keeps a copy of the report (Incident.mirror)."""
    try:
        incident.mirror(verdict, os.path.join(watcher.config.dump_dir, REPORT_NAME))
    except OSError as exc:
        log.warning("could not keep a copy of the hang report here: %s", exc)


def _awaiting_launcher(watcher: Watcher, kind: Any) -> bool:
    """A peer's process ended (this rank's collective lost its connection): when the wrapper
    took SIGTERM, give the launcher LAUNCHER_SIGTERM_WAIT_S to say whether it ends the job
    for it; its `terminated` incident then decides (a report only for a rank that left no
    final snapshot: killed, not a script that exited by itself with its own code)."""
    if watcher.term is None or watcher.term.received.is_set() or str(getattr(kind, "value", kind)) != "peer_error":
        return False
    if watcher.peer_error_at is None:
        watcher.peer_error_at = time.monotonic()
    return time.monotonic() - watcher.peer_error_at < LAUNCHER_SIGTERM_WAIT_S
