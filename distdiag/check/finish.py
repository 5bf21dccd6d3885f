"""How one rank's check ends: consolidate what every rank posted, write and share the report,
publish the verdict, and leave together (distdiag.check.run drives the run up to here).

Two ends: the normal one, where rank 0 consolidates after the last probe (CheckRun._finish
calls `consolidate`, `emit`, `after_verdict`), and the broken one, where the sentinel of the
rank that claims the writer builds the report from the ranks' snapshots
(`write_abort_report`, on the sentinel's thread).
"""

from __future__ import annotations

import logging
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from distdiag.check.config import CheckConfig
from distdiag.check.consolidate import build_report, cancel_result, consolidate_probe, hang_result
from distdiag.check.hashseed import shared_hash_seed_note
from distdiag.check.leftovers import say_leaving, settle_leftovers
from distdiag.check.plan import Plan
from distdiag.check.shared_values import resolve_shared
from distdiag.check.starting import with_last_notes
from distdiag.errors import print_line
from distdiag.hang.records import EventKind, IncidentEvent, RankSnapshot, Verdict
from distdiag.launcher.ranks import cancelled_by, note_verdict, noted_rank
from distdiag.probes.base import ConsolidationView
from distdiag.report.model import EXIT_HANG, ProbeResult, RankInfo, Report
from distdiag.report.render import ProgressLine, render_report
from distdiag.runtime.exchange import Exchange, poll_interval
from distdiag.runtime.gcpause import collector_paused
from distdiag.runtime.incident import Incident, Seat
from distdiag.runtime.keys import IncidentKeys, Keys

if TYPE_CHECKING:
    import torch.distributed as dist

    from distdiag.check.ahead import Ahead
    from distdiag.runtime.context import LaunchInfo
    from distdiag.runtime.sentinel import Sentinel

__all__ = ["RunEnd", "LEAVE_WAIT_S"]

log = logging.getLogger("distdiag.check")

LEAVE_WAIT_S = 2.0
"""After the verdict, how long the count of ranks that said they are leaving may stand still
before a rank looks at the silent ones (a SIGSTOPped rank would keep torchrun waiting forever)."""
LEAVE_MAX_STALLS = 10
"""...and at most this many times LEAVE_WAIT_S in all, however the count moves."""


def _outcome(kinds: set[EventKind], *, cancelled: bool, lost: Mapping[int, str]) -> str:
    """The report's outcome of a broken run, from the kinds of reasons the ranks gave."""
    kinds = {EventKind(k) for k in kinds}
    return (
        "cancelled" if cancelled
        else "lost_rank" if lost or EventKind.LOST in kinds
        else "stranded" if EventKind.STRANDED in kinds
        else "deadline" if EventKind.DEADLINE in kinds
        else "hang" if EventKind.TIMEOUT in kinds
        else "terminated"
    )




def _all_left(ex: Exchange, world: int, stall_s: float) -> bool:
    """True once every rank said it is leaving; False once their count stood still for stall_s
    (or after LEAVE_MAX_STALLS times that in all). Not a fixed bound: at 16k ranks each rank
    polls the verdict every N / POLL_BUDGET_OPS_S s (0.66 s), so leaving takes seconds while the
    count keeps moving; a rank stopped or dead after the verdict makes it stand still."""
    interval = poll_interval(0.05, world)
    started = last_move = time.monotonic()
    last = -1
    if interval > 0.05:
        time.sleep(random.uniform(0, interval))  # spread the ranks' first looks
    while True:
        count = ex.count(Keys.LEFT)
        now = time.monotonic()
        if count >= world:
            return True
        if count != last:
            last, last_move = count, now
        if now - last_move >= stall_s or now - started >= LEAVE_MAX_STALLS * stall_s:
            return False
        time.sleep(min(interval, last_move + stall_s - now))


def _print(config: CheckConfig, report: Report, text: str, where: str | None) -> None:
    """The report on stdout, in the format asked for (`where`: the file written, if any)."""
    if config.format == "json":
        sys.stdout.write(text + "\n")
    elif config.quiet:
        sys.stdout.write(f"verdict: {report.verdict.upper()} (exit {report.exit_code}) - {report.summary}\n")
    else:
        sys.stdout.write(render_report(report, verbose=config.verbose) + "\n")
        if where:
            sys.stdout.write(f"report: {os.path.abspath(where)}\n")


class RunEnd:
    """One rank's end of the run: the report, the verdict, and leaving."""

    def __init__(self, config: CheckConfig, plan: Plan, info: LaunchInfo, started: float, progress: ProgressLine) -> None:
        self.config = config
        self.plan = plan
        self.info = info
        self.started = started
        self.progress = progress
        self.sentinel: Sentinel | None = None  # set once the run has started it
        self.rank_infos: list[RankInfo] = []
        self.verdict_report: Report | None = None  # the report this rank wrote on the normal end
        self.ahead: Ahead | None = None  # rank 0: the probes consolidated while the others ran (distdiag.check.ahead)
        self._leaving = threading.Lock()
        self._left_code: int | None = None

    # -- consolidate ------------------------------------------------------------------------
    def _view(self, options: object) -> ConsolidationView:
        return ConsolidationView(world_size=self.info.world_size, ranks=self.rank_infos, options=options)

    def _load_rank_infos(self, ex: Exchange) -> None:
        posted = ex.collect(Keys.INFO)
        self.rank_infos = [
            RankInfo.from_dict(posted[r]) if r in posted else RankInfo(r, "?", -1, -1, "?", -1)
            for r in range(self.info.world_size)
        ]

    def _checked_in(self) -> dict[int, RankInfo]:  # the real rows, not the '?' of ranks that never posted
        return {r: i for r, i in enumerate(self.rank_infos) if i.pid > 0}

    def _known_rank_infos(self) -> list[RankInfo]:
        """The report's rank table: each checked-in rank's own row; a rank that never checked
        in gets its pid and host from its note to this node's launcher, or this host when
        every rank starts on it; '?' only where nothing is known."""
        rows = []
        for r, info in enumerate(self.rank_infos):
            note = noted_rank(r) if info.pid <= 0 else None
            if info.pid > 0 or (note is None and self._one_host() is None):
                rows.append(info)
            else:
                pid = note["pid"] if note is not None else -1
                rows.append(RankInfo(r, self.info.host, self.info.node, -1, "?", pid))
        return rows

    def _one_host(self) -> str | None:
        """This host, when every rank of the job starts on it (one node)."""
        return self.info.host if self.info.local_world_size == self.info.world_size else None

    def consolidated(self, ex: Exchange, index: int) -> ProbeResult:
        """Probe `index`'s result, from what every rank posted of it."""
        planned = self.plan.probes[index]
        posted = resolve_shared(ex, index, ex.collect(Keys.result(index)))
        return consolidate_probe(planned.probe, posted, self._view(planned.options))

    def _completed(self, ex: Exchange, count: int) -> list[ProbeResult]:
        """The plan's first `count` probes' results: made ahead (`ahead`), or read now."""
        made = [self.ahead.result(i) if self.ahead is not None else None for i in range(count)]
        return [r if r is not None else self.consolidated(ex, i) for i, r in enumerate(made)]

    def consolidate_ahead(self, ex: Exchange, connect: Callable[[], dist.Store] | None = None) -> None:
        """Rank 0, once all checked in: each probe consolidated on a thread as it completes."""
        from distdiag.check.ahead import Ahead

        own = None if connect is None else lambda: Exchange(connect(), ex.rank, ex.world_size)
        self.ahead = Ahead(self.consolidated, ex, own, prepare=self._load_rank_infos)

    def consolidate(self, ex: Exchange) -> Report:
        """The report of a run whose every probe finished, written by this rank."""
        # A rank whose sentinel ends the run meanwhile waits for this verdict while it moves.
        with self.incident(ex).moving("consolidating the probes' results"), collector_paused():
            if self.ahead is not None:
                self.ahead.finish()
            if not self.rank_infos:
                self._load_rank_infos(ex)
            results = self._completed(ex, len(self.plan.probes))
            return self._report(results, [], outcome="completed", hung=False, writer=self.info.rank)

    def _report(self, results: list[ProbeResult], not_run: list[str], *, outcome: str, hung: bool, writer: int) -> Report:
        cfg = self.config.to_dict()
        report = build_report(
            world_size=self.info.world_size,
            ranks=self._known_rank_infos(),
            probes=results,
            not_run=not_run,
            outcome=outcome,
            hung=hung,
            restart_count=self.info.restart_count,
            run_id=self.info.run_id,
            duration_s=time.monotonic() - self.started,
            config=cfg,
            written_by=writer,
        )
        report.notes.extend(n for n in (shared_hash_seed_note(),) if n)
        return report

    # -- write and publish ------------------------------------------------------------------
    def incident(self, ex: Exchange) -> Incident:
        """The check's incident on `ex` (one per run: the bare keys), able to reconnect."""
        factory = getattr(self.sentinel, "store_factory", None)
        return Incident(ex, IncidentKeys(), self.info.world_size, factory, Seat.of(self.info))

    def emit(self, report: Report, ex: Exchange | Incident, *, show: bool = True) -> None:
        """Write the report atomically, print it (unless `show` is False), publish the small
        verdict the other ranks wait for, then the report's JSON for other nodes in chunks."""
        with collector_paused():
            self._emit(report, ex if isinstance(ex, Incident) else self.incident(ex), show)

    def _emit(self, report: Report, inc: Incident, show: bool) -> None:
        inc.advance("writing the report")
        text, where, why = inc.write(report, self.config.report)
        if where is None:
            print_line(f"distdiag: cannot write the report to {self.config.report}: {why}")
        note_verdict(report.exit_code, where is not None)
        self._write_junit(report)
        self.progress.clear()
        if report.outcome == "cancelled" and cancelled_by():
            show = False  # the user stopped distdiag check, which says so in one line
        if show:
            _print(self.config, report, text, where)
        sys.stdout.flush()
        inc.publish(report, text, where or "(not written)")

    def mirror(self, ex: Exchange, verdict: Verdict) -> None:
        """Local rank 0 of every other node writes the same report there (Incident.mirror)."""
        try:
            data = self.incident(ex).mirror(verdict, self.config.report)
        except OSError as exc:  # e.g. a link planted at the path since the check began
            note_verdict(verdict.exit_code, False)
            print_line(f"distdiag: cannot write the report to {self.config.report}: {exc.strerror}")
            return
        if data is not None:
            note_verdict(int(data.get("exit_code", EXIT_HANG)), True)
            self._write_junit(Report.from_dict(data))

    def _write_junit(self, report: Report) -> None:
        if not self.config.junit:
            return
        from distdiag.report.junit import write_junit

        try:
            write_junit(report, self.config.junit)
        except OSError as exc:
            print_line(f"distdiag: cannot write the JUnit XML to {self.config.junit}: {exc.strerror}")

    # -- leave ------------------------------------------------------------------------------
    def after_verdict(self, ex: Exchange, wait_s: float = LEAVE_WAIT_S) -> int:
        """Every rank says it is leaving and waits (bounded) for the others to say so too. A
        rank that does not - SIGSTOPped, or killed after the verdict - would keep torchrun
        waiting forever or pass for healthy: same-host stopped ones are ended by pid, and the
        rank that wrote the verdict adds them to the report (exit 3). Returns the exit code.
        Runs once: on the main thread, or on the sentinel's when a SIGTERM comes first (`ex` is
        then the sentinel's own store client)."""
        with self._leaving:
            if self._left_code is None:
                self._left_code = self._leave(wait_s, ex)
            return self._left_code

    def _leave(self, wait_s: float, ex: Exchange) -> int:
        from distdiag.runtime.incident import kill_stopped_local, silent_rank_reasons

        report = self.verdict_report
        code = report.exit_code if report is not None else int(self._sentinel().finishing_code or 0)
        stock = say_leaving(ex)
        world = self.info.world_size
        if settle_leftovers(stock, report, ex, self.config.report, everyone=_all_left(ex, world, wait_s)):
            return code
        missing = sorted(set(range(world)) - set(ex.present(Keys.LEFT)))
        # The silent ranks' rows only: each late rank reading all N rows was N^2 at 16k (issue 21).
        rows = (RankInfo.from_dict(v) for v in ex.collect(Keys.INFO, missing).values())
        infos = {i.rank: i for i in rows if i.pid > 0}
        reasons = silent_rank_reasons(missing, infos, self.info.host, starting_host=self._one_host())
        kill_stopped_local(reasons, infos, self.info.host)
        definite = {r: why for r, why in reasons.items() if why.reason.definite}
        if report is None or not definite:
            return code
        return self._rewrite_lost_after_verdict(report, definite, ex)

    def _rewrite_lost_after_verdict(self, report: Report, definite: Mapping[int, str], ex: Exchange) -> int:
        """Ranks gone or stopped after the verdict: the written report now says so (exit 3)."""
        from distdiag.check.consolidate import after_verdict_result

        report.probes.append(after_verdict_result(definite))
        report.exit_code = EXIT_HANG
        report.verdict = "fail"
        report.outcome = "lost_rank"
        report.summary = report.probes[-1].findings[0].issue
        self.emit(report, ex, show=False)
        print_line(f"distdiag: {report.summary}; the report now says exit {EXIT_HANG}: {os.path.abspath(self.config.report)}")
        self._sentinel().finishing_code = EXIT_HANG
        return EXIT_HANG

    def _sentinel(self) -> Sentinel:
        assert self.sentinel is not None, "the sentinel starts before the run can end"
        return self.sentinel

    # -- the broken end (called on the sentinel thread of the rank that claims the writer) --
    def write_abort_report(self, incident: Incident, reason: IncidentEvent) -> int:
        """The broken run's report from every rank's snapshot; the verdict published first."""
        with collector_paused():
            return self._write_abort_report(incident, reason)

    def _write_abort_report(self, incident: Incident, reason: IncidentEvent) -> int:
        from distdiag.runtime.incident import collect_snapshots, kill_stopped_local, silent_rank_reasons

        ex, world = incident.ex, self.info.world_size
        if self.ahead is not None:
            self.ahead.stop()  # what it made is used; the rest is read here
        incident.advance("reading the snapshots")
        self._load_rank_infos(ex)
        snaps = collect_snapshots(ex, incident.keys.snap, histories=True)
        typed = {r: RankSnapshot.from_dict(s) for r, s in snaps.items()}
        reasons = {int(r): IncidentEvent.from_dict(v) for r, v in ex.collect(Keys.ABORT_REASON).items()}
        infos = self._checked_in()
        silent = [r for r in range(world) if r not in snaps]
        lost, signalled = with_last_notes(silent_rank_reasons(silent, infos, self.info.host, starting_host=self._one_host()), infos)
        # Where did the run stop? The lowest step any live rank was still in.
        indices = [s.probe_index for s in typed.values() if s.phase in ("probe", "barrier")]
        final = all(s.phase == "final" for s in typed.values()) and typed
        cur = min(indices) if indices else (len(self.plan.probes) if final else -1)
        results = self._completed(ex, max(cur, 0))
        name, errors, comm_errors = self._errors_where_stopped(ex, cur, final)
        first = reasons.get(min(reasons)) if reasons else reason
        detail = first.detail_line() if first else ""
        if comm_errors and not lost:
            for r, err in comm_errors.items():
                errors.setdefault(r, err)
        kinds = {r.kind for r in reasons.values()} or {reason.kind}
        # Every rank that said why it stopped was told to by a signal, and none is lost or
        # raised: the run was cancelled (Ctrl-C, scancel, a preemption), nobody is at fault.
        # Ranks still starting when the user's Ctrl-C reached distdiag check died of the signal
        # before they could check in, or noted it while importing (`signalled`): that is the
        # cancellation too, not a lost rank.
        cancelled = kinds == {EventKind.TERMINATED} and not errors and (not set(lost) - signalled or cancelled_by() is not None)
        duration = time.monotonic() - self.started
        with incident.moving(f"analysing {len(snaps)} snapshot(s)"):
            if cancelled:
                result = cancel_result(name, snaps, world, reason=detail, duration_s=duration)
            else:
                result = hang_result(
                    name, snaps, lost, errors, world, timeout_s=self.config.timeout_s, reason=detail,
                    duration_s=duration, infos=dict(enumerate(self._known_rank_infos())),
                )
        results.append(result)
        not_run = [p.probe.name for p in self.plan.probes[cur + 1 :]] if cur >= 0 else self.plan.names
        outcome = _outcome(kinds, cancelled=cancelled, lost=lost)
        report = self._report(results, not_run, outcome=outcome, hung=True, writer=self.info.rank)
        self.emit(report, incident)
        kill_stopped_local(lost, dict(enumerate(self.rank_infos)), self.info.host)
        return report.exit_code

    def _errors_where_stopped(self, ex: Exchange, cur: int, final: object) -> tuple[str, dict[int, Any], dict[int, Any]]:
        """(the step the run stopped in, the errors ranks posted there, the broken connections
        they posted there); `cur` is the probe's index, or -1 / past the last for setup / final."""
        if 0 <= cur < len(self.plan.probes):
            name = self.plan.probes[cur].probe.name
            posted = ex.collect(Keys.result(cur))
            errors = {r: p["error"] for r, p in posted.items() if p["status"] == "error" and not p.get("comm_error")}
            comm_errors = {r: {**p["error"], "comm": True} for r, p in posted.items() if p.get("comm_error")}
        else:
            name = "final" if final else "setup"
            errors = {int(r): e for r, e in ex.collect(Keys.SETUP_ERROR).items()} if name == "setup" else {}
            comm_errors = {}
        # Exceptions a probe caught and went on from, posted the moment they were caught: when
        # they stranded the others, they lead (the rank itself may be waiting somewhere else now).
        for r, err in ex.collect(Keys.caught(cur)).items():
            errors.setdefault(int(r), {**err, "caught": True})
        return name, errors, comm_errors
