"""The sentinel: one daemon thread per rank that ends a broken run with a report.

The main thread runs probes and may block forever in a collective (a hung gloo collective
cannot be aborted from another thread, docs/facts.md). The sentinel keeps a heartbeat in the
store, watches the probe deadline, the whole-check deadline, SIGTERM from the launcher and
the job-wide `abort` flag. When any of them fires on any rank, every sentinel posts a
snapshot of its main thread (phase, collective, stack); one sentinel claims the writer role,
consolidates what the store holds into a report naming the culprits, writes it and publishes
the verdict; then every rank leaves with `os._exit(code)` - after the report is written.
The steps shared with the watchdog (snapshot, claim, verdict, the wait that follows the
writer's progress) are distdiag/runtime/incident.py; the report is the check's callback.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from distdiag.errors import print_line
from distdiag.hang.records import EventKind, IncidentEvent, RankSnapshot, Verdict
from distdiag.report.model import EXIT_HANG
from distdiag.runtime.exchange import Exchange, poll_interval
from distdiag.runtime.incident import (
    WRITER_STALL_S,
    Incident,
    Seat,
    kill_pid,
    kill_stopped_local,
    process_state,
    silent_rank_reasons,
)
from distdiag.runtime.keys import IncidentKeys, Keys
from distdiag.runtime.tracker import Tracker

if TYPE_CHECKING:
    import torch.distributed as dist

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = [
    "Sentinel", "install_sigterm_wakeup", "flush_and_exit", "process_state", "silent_rank_reasons",
    "kill_pid", "kill_stopped_local", "at_abort", "cancel_at_abort",
]

log = logging.getLogger("distdiag.runtime.sentinel")

TICK_S = 0.1
TIMING_TICK_S = 1.0
"""The tick while the main thread times a collective (Tracker.timed): each tick costs a store
round trip, which on a loaded CPU host showed in the bandwidth probe's small-message times."""
TIMING_QUIET_MAX_S = 5.0
"""A timed stretch longer than this is probably stuck: the sentinel goes back to TICK_S so a
peer's abort is seen as fast as anywhere else."""

HEARTBEAT_EVERY_S = 0.5
HEARTBEAT_BUDGET_OPS_S = 5_000.0
"""Heartbeats per second all ranks together may send the store: at 16k ranks one every 3.3 s
per rank. Nothing of ours decides on a heartbeat (snapshots and pid checks do); it is for an
operator reading the store, so it is the standing poll that yields most."""


def standing_intervals(world: int) -> tuple[float, float]:
    """(the interval of a rank's look at the job's abort flag, of its heartbeat) for `world`
    ranks: the look at TICK_S (and the heartbeat at HEARTBEAT_EVERY_S) up to the world the
    store's poll budget holds (2,500 ranks), then slower, so that the standing traffic of the whole job stays within POLL_BUDGET_OPS_S +
    HEARTBEAT_BUDGET_OPS_S requests a second (about a fifth of one store core at 16k ranks;
    it was 196,608 a second there, one core and more). The local deadlines and SIGTERM are
    still looked at every tick."""
    return poll_interval(TICK_S, world), max(HEARTBEAT_EVERY_S, world / HEARTBEAT_BUDGET_OPS_S)
SNAPSHOT_GRACE_S = 2.0
"""How long the writer waits for every live rank's snapshot once a run is aborted."""
VERDICT_STALL_S = WRITER_STALL_S
"""How long a non-writer waits for the writer's progress to move before leaving with exit
code 3 on its own (distdiag/runtime/incident.py: the wait follows the writer, not a clock)."""
WRITER_DEFER_S = 1.0
"""How long a rank that is not waiting on anyone (a possible culprit) defers the writer role."""


def tick_s(tracker: Tracker, now: float) -> float:
    """How long the sentinel sleeps between looks (SIGTERM wakes it at once regardless)."""
    if tracker.timing and now - tracker.timing_since < TIMING_QUIET_MAX_S:
        return TIMING_TICK_S
    return TICK_S


_wakeup_read_fd: int | None = None


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""What ends a run from outside: torchrun's SIGTERM (another worker failed, or the job was
cancelled), and SIGINT (Ctrl-C; torchrun passes the signal it got on to its workers)."""


def install_sigterm_wakeup() -> None:
    """Route SIGTERM and SIGINT to the sentinel, whatever thread the kernel delivers them to.

    torch starts a thread at import, so blocking SIGTERM in the main thread alone would let
    the default action kill the process. Instead a no-op Python handler keeps the process
    alive and the C-level handler writes the signal number to a wakeup pipe the sentinel
    reads. SIGINT gets the same treatment: a KeyboardInterrupt in the main thread would end
    a rank mid-probe without a report, and cannot reach a rank blocked in a collective anyway.
    Call from the main thread.
    """
    global _wakeup_read_fd
    if _wakeup_read_fd is not None:
        return
    from distdiag.runtime.early import wakeup_pipe

    # The pipe made before torch was imported (python -m distdiag.check) holds any stop signal
    # that came meanwhile: the sentinel acts on it as soon as it starts.
    read_fd, write_fd = wakeup_pipe() or os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    for sig in _STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: None)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    _wakeup_read_fd = read_fd
    # A process the user's code forks from this rank (os.fork, multiprocessing) would inherit
    # the no-op handlers and the pipe: a SIGTERM meant for it would wake this rank's sentinel
    # instead (read as the launcher's), and the child could not be ended by SIGTERM.
    os.register_at_fork(after_in_child=_default_signals_in_child)


def _default_signals_in_child() -> None:
    """In a process forked from a rank: the stop signals' default actions, no wakeup pipe."""
    global _wakeup_read_fd
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    except (ValueError, OSError):  # not the main thread: leave it as it is
        return
    if _wakeup_read_fd is not None:
        try:
            os.close(_wakeup_read_fd)
        except OSError:
            pass
        _wakeup_read_fd = None


def _sigterm_pending(timeout: float) -> str | None:
    """The name of a stop signal that arrived within `timeout` (SIGTERM, SIGINT), else None."""
    if _wakeup_read_fd is None:
        time.sleep(timeout)
        return None
    ready, _, _ = select.select([_wakeup_read_fd], [], [], timeout)
    if not ready:
        return None
    try:
        data = os.read(_wakeup_read_fd, 512)
    except BlockingIOError:
        return None
    for sig in _STOP_SIGNALS:
        if int(sig) in data:
            return sig.name
    return None


_AT_ABORT: dict[int, Callable[[], None]] = {}
_at_abort_next = [0]


def at_abort(cleanup: Callable[[], None]) -> int:
    """Run `cleanup` if the process is ended by `flush_and_exit` (a hang, a lost rank, a
    verdict reached while this thread is stuck): the main thread's `finally` blocks never run
    then. Returns a token for `cancel_at_abort` (call it once the normal path cleaned up)."""
    _at_abort_next[0] += 1
    _AT_ABORT[_at_abort_next[0]] = cleanup
    return _at_abort_next[0]


def cancel_at_abort(token: int) -> None:
    _AT_ABORT.pop(token, None)


def _run_at_abort() -> None:
    for token in list(_AT_ABORT):
        cleanup = _AT_ABORT.pop(token, None)
        if cleanup is None:
            continue
        try:
            cleanup()
        except Exception as exc:  # noqa: BLE001 - leaving anyway; say what was left behind
            print_line(f"distdiag: cleanup at exit failed: {type(exc).__name__}: {exc}")


def flush_and_exit(code: int) -> NoReturn:
    """Run the `at_abort` cleanups, flush what was printed and logged, then end the process at
    once (any thread may call it). A failing verdict this rank published or received goes to
    torchrun's error file first (runtime/lastword.py): its root cause then says it."""
    from distdiag.runtime.lastword import write_error_file

    write_error_file(code)
    _run_at_abort()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - leaving anyway
            pass
    logging.shutdown()
    os._exit(code)


class Sentinel(threading.Thread):
    """Per-rank watcher. `write_abort_report` is the check's callback that builds the report."""

    def __init__(
        self,
        *,
        store_factory: Callable[[], dist.Store],
        rank: int,
        world_size: int,
        seat: Seat,
        tracker: Tracker,
        timeout_s: float,
        setup_timeout_s: float,
        deadline_at: float,
        write_abort_report: Callable[[Incident, IncidentEvent], int],
        mirror: Callable[[Exchange, Verdict], None] | None = None,
        on_abort: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(name="distdiag-sentinel", daemon=True)
        self.store_factory = store_factory
        self.rank = rank
        self.world_size = world_size
        self.seat = seat
        self.host = seat.host
        self.tracker = tracker
        self.timeout_s = timeout_s
        self.setup_timeout_s = setup_timeout_s
        self.deadline_at = deadline_at
        self.write_abort_report = write_abort_report
        self.mirror = mirror
        """On a node other than the writer's, writes the report there (no shared FS assumed)."""
        self.on_abort = on_abort
        """Called first when this rank starts ending a broken run (the check blanks rank 0's
        progress line there: another rank may print the verdict while this one is stuck)."""
        self.aborting = threading.Event()
        self.finishing_code: int | None = None
        """Set by the main thread once the verdict is known: SIGTERM then just exits with it."""
        self.on_late_sigterm: Callable[[], int] | None = None
        """On the rank that wrote the verdict: called (bounded) by a SIGTERM that comes after
        it, which means a peer failed after the verdict; returns the code to leave with."""
        self._trigger: IncidentEvent | None = None
        self._lock = threading.Lock()
        self._looked_at = float("-inf")
        self._look_every = TICK_S
        self.exchange: Exchange | None = None
        self.started_ok = threading.Event()

    # -- called from the main thread ---------------------------------------------------
    def trigger(self, kind: EventKind | str, detail: str) -> None:
        """Ask the sentinel to end the run (it acts within one tick)."""
        with self._lock:
            if self._trigger is None:
                self._trigger = IncidentEvent.from_dict({"kind": kind, "detail": detail, "rank": self.rank})

    # -- the thread ----------------------------------------------------------------------
    def run(self) -> None:
        try:
            self.exchange = exchange = Exchange(self.store_factory(), self.rank, self.world_size)
        except Exception as exc:  # noqa: BLE001 - without a store nothing can be reported
            print_line(f"distdiag[rank {self.rank}]: cannot reach the job's store: {exc}")
            flush_and_exit(EXIT_HANG)
        self.started_ok.set()
        last_beat = 0.0
        self._look_every, beat_every = standing_intervals(self.world_size)
        try:
            while True:
                sig = _sigterm_pending(tick_s(self.tracker, time.monotonic()))
                if sig is not None:
                    if self.finishing_code is not None:
                        code = self.finishing_code
                        if self.on_late_sigterm is not None:
                            try:
                                code = self.on_late_sigterm()
                            except Exception as exc:  # noqa: BLE001 - leave with the verdict's code
                                log.warning("could not look at the ranks after the verdict: %s", exc)
                        flush_and_exit(code)
                    what = "SIGINT (Ctrl-C)" if sig == "SIGINT" else "SIGTERM"
                    self.trigger(EventKind.TERMINATED, f"rank {self.rank} received {what} from the launcher (another worker failed or the job was cancelled)")
                now = time.monotonic()
                if now - last_beat >= beat_every:
                    exchange.bump(Keys.heartbeat(self.rank))
                    last_beat = now
                if self.finishing_code is not None:
                    continue
                reason = self._check(now)
                if reason is not None:
                    self._emergency(reason)
        except Exception as exc:  # noqa: BLE001 - the store went away (agent gone): leave
            if self.finishing_code is not None:
                flush_and_exit(self.finishing_code)
            print_line(f"distdiag[rank {self.rank}]: lost the job's store ({type(exc).__name__}: {exc}); exiting 3")
            flush_and_exit(EXIT_HANG)

    def _check(self, now: float) -> IncidentEvent | None:
        with self._lock:
            if self._trigger is not None:
                return self._trigger
        assert self.exchange is not None
        if now - self._looked_at >= self._look_every:
            self._looked_at = now
            if self.exchange.count(Keys.ABORT_REASON) > 0:
                return IncidentEvent(EventKind.PEER, "another rank aborted the run", self.rank)
        phase, since = self.tracker.phase, self.tracker.phase_since
        # Only the wait for every rank to check in (ranks still importing torch) gets the long
        # limit; setup proper (the target, the process groups) is bounded like a probe.
        limit = self.setup_timeout_s if phase == "checkin" else self.timeout_s
        if phase in ("checkin", "setup", "probe", "barrier", "final") and now - since > limit:
            where = f"probe '{self.tracker.probe_name}'" if phase in ("probe", "barrier") else f"the {phase} phase"
            return IncidentEvent(EventKind.TIMEOUT, f"{where} exceeded its deadline of {limit:g}s on rank {self.rank}", self.rank)
        if now > self.deadline_at:
            return IncidentEvent(EventKind.DEADLINE, "the whole check exceeded --deadline-s", self.rank)
        return None

    def _emergency(self, reason: IncidentEvent) -> None:
        assert self.exchange is not None
        incident = Incident(self.exchange, IncidentKeys(), self.world_size, self.store_factory, self.seat)
        self.aborting.set()
        if self.on_abort is not None:
            try:
                self.on_abort()
            except Exception as exc:  # noqa: BLE001 - cosmetic: never in the way of the report
                log.debug("on_abort failed: %s", exc)
        incident.declare(reason)
        snap = RankSnapshot.from_dict(self.tracker.snapshot())
        snap.rank, snap.host, snap.pid, snap.event, snap.event_key = self.rank, self.host, os.getpid(), reason, "reason"
        incident.post_snapshot(snap)
        incident.wait_snapshots(time.monotonic() + SNAPSHOT_GRACE_S + 0.002 * self.world_size)
        from distdiag.hang import rank_state

        if rank_state(snap) != "collective" and snap.phase in ("checkin", "setup", "probe"):
            # This rank may be the culprit (it is not waiting on anyone): let a rank that is
            # only waiting write the report, so a stuck rank 0 is reported by another rank.
            time.sleep(WRITER_DEFER_S)
        flush_and_exit(self._write(incident, reason) if incident.claim_writer("sentinel") else self._await(incident))

    def _write(self, incident: Incident, reason: IncidentEvent) -> int:
        """This rank writes the report (the check's callback publishes the verdict first)."""
        try:
            return self.write_abort_report(incident, reason)
        except Exception as exc:  # noqa: BLE001 - say so, still publish a verdict and leave with 3
            import traceback

            print_line(f"distdiag[rank {self.rank}]: failed to write the report: {exc}")
            traceback.print_exc()
            incident.publish_verdict(Verdict(3, self.rank, self.host, self.seat.node, outcome="error",
                                             summary=f"the writer failed to write the report: {type(exc).__name__}"))
            return EXIT_HANG

    def _await(self, incident: Incident) -> int:
        """Wait for the verdict while the writer moves; this node's copy of the report; the code."""
        verdict, why = incident.wait_verdict(VERDICT_STALL_S)
        if verdict is None:
            print_line(f"distdiag[rank {self.rank}]: no verdict: {why}; exiting 3")
            return EXIT_HANG
        if self.mirror is not None:
            try:
                self.mirror(incident.ex, verdict)
            except Exception as exc:  # noqa: BLE001 - the writer's copy exists
                log.warning("could not mirror the report on this node: %s", exc)
        return verdict.exit_code
