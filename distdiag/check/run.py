"""`torchrun --nproc-per-node N -m distdiag.check`: run the probes, print one verdict, exit.

Flow on every rank: parse and validate (bad input -> one line, exit 2), connect to the job's
store, start the sentinel, init the process groups, then for each probe: run it, post the
result to the store, wait until every rank posted. Rank 0 consolidates, writes the report,
prints the table and publishes the verdict; every rank exits with the verdict's code after
the report is written. When a rank hangs, dies or raises, the sentinels end the run instead
(distdiag.runtime.sentinel) and one of them writes the report.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from distdiag.check.config import CheckConfig
from distdiag.check.consolidate import build_report, cancel_result, consolidate_probe, hang_result
from distdiag.check.plan import Plan, make_plan, parse_config
from distdiag.errors import ConfigError, error_summary, mentions_broken_connection
from distdiag.probes.base import ConsolidationView
from distdiag.report.model import (
    EXIT_BAD_INPUT,
    EXIT_HANG,
    ProbeResult,
    RankInfo,
    Report,
    write_report,
)
from distdiag.report.render import ProgressLine, render_report
from distdiag.runtime.exchange import Exchange
from distdiag.runtime.faults import FaultPlan

__all__ = ["main", "run_check"]

log = logging.getLogger("distdiag.check")

ACK_WAIT_S = 3.0
LEAVE_WAIT_S = 2.0
"""After the verdict, how long a rank waits for the others to say they are leaving before it
looks at the silent ones (a SIGSTOPped rank would keep torchrun waiting forever)."""
CHECKIN_MIN_S = 60.0


def checkin_limit(timeout_s: float) -> float:
    """How long ranks wait for every rank to check in: torch's import takes seconds per rank on
    a loaded node, whatever --timeout-s says; never less than the probe deadline."""
    return max(timeout_s, CHECKIN_MIN_S)


def _is_comm_error(exc: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(exc, getattr(dist, "DistError", ())) or mentions_broken_connection(exc)


def _print_err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class CheckRun:
    """One rank's run of the plan."""

    def __init__(self, config: CheckConfig, plan: Plan, info: Any) -> None:
        from distdiag.runtime.tracker import Tracker

        self.config = config
        self.plan = plan
        self.info = info
        self.tracker = Tracker()
        self.tracker.enter_phase("checkin")
        self.faults = FaultPlan.from_env(info.rank)
        self.started = time.monotonic()
        self.rank_infos: list[RankInfo] = []
        self.results: list[ProbeResult] = []
        self._caught_posted: set[int] = set()
        self._leaving = threading.Lock()
        self._left_code: int | None = None
        self.progress = ProgressLine.for_check(config, info.rank)  # rank 0 on a terminal only (render.py)

    # -- store and sentinel ---------------------------------------------------------------
    def _store(self) -> Any:
        from distdiag.runtime.context import connect_store

        return connect_store(self.info, timedelta(seconds=max(30.0, self.config.timeout_s)))

    def execute(self) -> int:
        import torch

        from distdiag.runtime.comm import Comm
        from distdiag.runtime.context import RankContext, init_process_groups, pick_device
        from distdiag.runtime.sentinel import Sentinel, install_sigterm_wakeup

        info, cfg = self.info, self.config
        install_sigterm_wakeup()
        try:
            self.store = self._store()
        except Exception as exc:  # noqa: BLE001 - nothing can be reported without the store
            where = f"{info.master_addr}:{info.master_port}" if info.distributed else "in-process"
            _print_err(f"distdiag[rank {info.rank}]: cannot reach the job's store at {where}: {exc}")
            return 3
        self.ex = Exchange(self.store, info.rank, info.world_size)
        from distdiag.errors import set_caught_publisher

        set_caught_publisher(self._publish_caught)
        setup_exc = None
        try:
            device, backend = pick_device(info)
        except Exception as exc:  # noqa: BLE001 - a broken GPU: report it, do not just die
            device, backend = torch.device("cpu"), "gloo"
            setup_exc = exc
        self.sentinel = Sentinel(
            store_factory=self._store,
            rank=info.rank,
            world_size=info.world_size,
            host=info.host,
            tracker=self.tracker,
            timeout_s=cfg.timeout_s,
            setup_timeout_s=checkin_limit(cfg.timeout_s),
            deadline_at=self.started + cfg.deadline_s,
            write_abort_report=self._write_abort_report,
            mirror=self._mirror,
        )
        self.sentinel.start()
        self.sentinel.started_ok.wait(30)
        if setup_exc is not None:
            self.ex.post("setup_error", error_summary(setup_exc))
            self.sentinel.trigger("setup", f"rank {info.rank} could not select its device: {type(setup_exc).__name__}")
            self._park()

        self.ex.post("info", RankInfo(info.rank, info.host, info.node, info.local_rank, str(device), info.pid).to_dict())
        self._wait_for_checkin()
        self.tracker.enter_phase("setup")
        target = self._load_target_everywhere()
        from distdiag.hang.recorder import enable_recorder

        # Before init: the recorder's buffer is sized when a process group is created. It is
        # how a hang report sees collectives torch issues itself (DCP, FSDP, hooks).
        enable_recorder(2000)
        try:
            self.faults.at("setup", 0)
            side_group = init_process_groups(info, self.store, backend, device, timedelta(seconds=cfg.deadline_s + 60))
        except Exception as exc:  # noqa: BLE001 - e.g. an NCCL or device error: a finding, not a traceback
            self.ex.post("setup_error", error_summary(exc))
            self.sentinel.trigger("setup", f"rank {info.rank} could not init the process group: {type(exc).__name__}")
            self._park()
        torch.manual_seed(1234)
        ctx = RankContext(
            info=info, device=device, backend=backend, tracker=self.tracker,
            comm=Comm(self.tracker, self.faults), store=self.store, side_group=side_group, faults=self.faults,
            target=target,
        )
        for index, planned in enumerate(self.plan.probes):
            self._run_probe(ctx, index, planned)
        return self._finish()

    def _wait_for_checkin(self) -> None:
        """Every rank posts its row of the rank table once it has imported torch and reached the
        store; ranks start seconds apart on a loaded node, so this wait alone has the longer
        limit. A rank that never checks in is named as such, not as lost on host '?'."""
        limit = checkin_limit(self.config.timeout_s)
        world = self.info.world_size
        if not self.ex.wait_count("info", world, time.monotonic() + limit, poll_s=0.05, stop=self.sentinel.aborting.is_set):
            if not self.sentinel.aborting.is_set():
                missing = sorted(set(range(world)) - set(self.ex.present("info")))
                self.sentinel.trigger("setup", f"ranks {missing} did not check in within {limit:g}s")
            self._park()

    def _publish_caught(self, exc: BaseException, where: str) -> None:
        """A probe caught `exc` and goes on: post it now, before its next collective (the first
        one per probe and rank: later ones are usually consequences)."""
        index = self.tracker.probe_index
        if index in self._caught_posted:
            return
        self._caught_posted.add(index)
        summary = error_summary(exc)
        summary.update({"where": where, "probe": self.tracker.probe_name, "phase": self.tracker.phase})
        self.ex.post(f"caught/{index}", summary)

    def _load_target_everywhere(self) -> Any:
        """Load the user's target on every rank; if any rank fails, every rank exits 2.

        A target can fail on one node only (a file missing there), so ranks agree through the
        store before anyone initialises a process group that the failed rank would never join.
        """
        from distdiag.check.target import load_target

        error = None
        target = None
        if self.config.target:
            try:
                target = load_target(self.config.target)
            except ConfigError as exc:
                error = str(exc)
        self.ex.post("valid", error)
        limit = self.config.timeout_s
        if not self.ex.wait_count("valid", self.info.world_size, time.monotonic() + limit):
            missing = sorted(set(range(self.info.world_size)) - set(self.ex.collect("valid")))
            self.sentinel.trigger("setup", f"ranks {missing} did not finish loading the target within {limit:g}s")
            self._park()
        errors = {r: e for r, e in self.ex.collect("valid").items() if e}
        if errors:
            first = min(errors)
            where = "" if len(errors) == self.info.world_size else f" (on rank {first})"
            exc = ConfigError(f"{errors[first]}{where}")
            self.sentinel.finishing_code = EXIT_BAD_INPUT
            code = _bad_input(exc, [], report_path=self.config.report)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return target

    def _run_probe(self, ctx: Any, index: int, planned: Any) -> None:
        probe = planned.probe
        self.progress.show(index, len(self.plan.probes), probe.name)
        self.tracker.enter_phase("probe", index, probe.name)
        started = time.perf_counter()
        entry: dict[str, Any]
        if planned.skip_reason:
            entry = {"status": "skip", "reason": planned.skip_reason}
        else:
            ctx.options = planned.options
            try:
                reason = probe.missing_api_reason() or probe.skip_reason(ctx)
                if reason:
                    entry = {"status": "skip", "reason": reason}
                else:
                    self.faults.at(probe.name, 0)
                    entry = {"status": "ok", "payload": probe.run(ctx)}
            except Exception as exc:  # noqa: BLE001 - a probe's exception is a finding
                entry = {"status": "error", "error": error_summary(exc), "comm_error": _is_comm_error(exc)}
        entry["duration_s"] = round(time.perf_counter() - started, 4)
        self.tracker.enter_phase("barrier", index, probe.name)
        key = f"res/{index}"
        self.ex.post(key, entry)
        if entry["status"] == "error":
            self.ex.bump(f"err/{index}")
            if entry.get("comm_error"):
                self.ex.bump(f"commerr/{index}")
        posted = time.monotonic()
        # Half the probe deadline: ranks that raise at different times (one computes
        # longer) must not be taken for ranks stranded in a collective.
        grace = self.config.timeout_s / 2
        while not self.ex.wait_count(key, self.info.world_size, time.monotonic() + 0.25, stop=self.sentinel.aborting.is_set):
            if self.sentinel.aborting.is_set():
                self._park()
            if self.ex.bump(f"commerr/{index}", 0) > 0:
                self.sentinel.trigger("lost", f"a rank lost its connection to a peer during probe '{probe.name}'")
                self._park()
            if time.monotonic() - posted > grace and self.ex.bump(f"err/{index}", 0) > 0:
                self.sentinel.trigger("stranded", f"probe '{probe.name}' raised on a rank; others did not finish")
                self._park()
        if self.ex.bump(f"commerr/{index}", 0) > 0:
            # Every rank answered, but a connection broke: the main group is unusable now.
            self.sentinel.trigger("lost", f"a connection between ranks broke during probe '{probe.name}'")
            self._park()

    def _park(self) -> None:
        """The sentinel is ending the run: wait for it to exit the process."""
        self.sentinel.aborting.wait(self.config.deadline_s)
        time.sleep(self.config.timeout_s + 60)
        _print_err(f"distdiag[rank {self.info.rank}]: the sentinel did not end the run; exiting 3")
        os._exit(3)

    # -- the normal end --------------------------------------------------------------------
    def _finish(self) -> int:
        info = self.info
        self.tracker.enter_phase("final")
        self.faults.at("final", 0)
        if info.rank == 0:
            if not self.ex.claim("writer", "main"):
                self._park()
            report = self._consolidate()
            self._emit(report)
            self._verdict_report = report
            self.sentinel.finishing_code = report.exit_code
            self.sentinel.on_late_sigterm = lambda: self._after_verdict(wait_s=0.5, ex=self.sentinel.exchange)
            self.ex.wait_count("ack", info.world_size - 1, time.monotonic() + ACK_WAIT_S)
            return self._after_verdict()
        verdict = None
        while verdict is None:
            verdict = self.ex.wait_read("verdict", time.monotonic() + 0.5, stop=self.sentinel.aborting.is_set)
            if self.sentinel.aborting.is_set():
                self._park()
        code = int(verdict["exit_code"])
        # This node's copy first: once finishing_code is set, a SIGTERM from torchrun (another
        # local rank already left non-zero) ends this process at once.
        self._mirror(self.ex, verdict)
        self.sentinel.finishing_code = code
        self.ex.post("ack", 1)
        self._after_verdict()
        return code

    def _after_verdict(self, wait_s: float = LEAVE_WAIT_S, ex: Exchange | None = None) -> int:
        """Every rank says it is leaving and waits (bounded) for the others to say so too. A
        rank that does not - SIGSTOPped, or killed after the verdict - would keep torchrun
        waiting forever or pass for healthy: same-host stopped ones are ended by pid, and the
        rank that wrote the verdict adds them to the report (exit 3). Returns the exit code.
        Runs once: on the main thread, or on the sentinel's when a SIGTERM comes first (`ex` is
        then the sentinel's own store client)."""
        with self._leaving:
            if self._left_code is None:
                self._left_code = self._leave(wait_s, ex or self.ex)
            return self._left_code

    def _leave(self, wait_s: float, ex: Exchange) -> int:
        from distdiag.runtime.sentinel import kill_stopped_local, silent_rank_reasons

        report = getattr(self, "_verdict_report", None)
        code = report.exit_code if report is not None else int(self.sentinel.finishing_code or 0)
        ex.post("left", 1)
        world = self.info.world_size
        if ex.wait_count("left", world, time.monotonic() + wait_s, poll_s=0.05):
            return code
        missing = sorted(set(range(world)) - set(ex.present("left")))
        self._load_rank_infos(ex)
        infos = dict(enumerate(self.rank_infos))
        reasons = silent_rank_reasons(missing, infos, self.info.host)
        kill_stopped_local(reasons, infos, self.info.host)
        definite = {r: why for r, why in reasons.items() if "is gone" in why or "stopped" in why}
        if report is None or not definite:
            return code
        from distdiag.check.consolidate import after_verdict_result

        report.probes.append(after_verdict_result(definite))
        report.exit_code = EXIT_HANG
        report.verdict = "fail"
        report.outcome = "lost_rank"
        report.summary = report.probes[-1].findings[0].issue
        self._emit(report, ex, show=False)
        _print_err(f"distdiag: {report.summary}; the report now says exit {EXIT_HANG}: {os.path.abspath(self.config.report)}")
        self.sentinel.finishing_code = EXIT_HANG
        return EXIT_HANG

    def _view(self, options: Any) -> ConsolidationView:
        return ConsolidationView(world_size=self.info.world_size, ranks=self.rank_infos, options=options)

    def _load_rank_infos(self, ex: Exchange) -> None:
        posted = ex.collect("info")
        self.rank_infos = [
            RankInfo.from_dict(posted[r]) if r in posted else RankInfo(r, "?", -1, -1, "?", -1)
            for r in range(self.info.world_size)
        ]

    def _completed(self, ex: Exchange, count: int) -> list[ProbeResult]:
        """The consolidated results of the plan's first `count` probes, from the store."""
        return [
            consolidate_probe(planned.probe, ex.collect(f"res/{index}"), self._view(planned.options))
            for index, planned in enumerate(self.plan.probes[:count])
        ]

    def _consolidate(self) -> Report:
        self._load_rank_infos(self.ex)
        results = self._completed(self.ex, len(self.plan.probes))
        return self._report(results, [], outcome="completed", hung=False, writer=self.info.rank)

    def _report(self, results: list[ProbeResult], not_run: list[str], *, outcome: str, hung: bool, writer: int) -> Report:
        cfg = self.config.to_dict()
        return build_report(
            world_size=self.info.world_size,
            ranks=self.rank_infos,
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

    def _emit(self, report: Report, ex: Exchange | None = None, *, show: bool = True) -> None:
        """Write the report atomically, keep a copy in the store for other nodes, print it
        (unless `show` is False), then publish the verdict the other ranks wait for."""
        ex = ex or self.ex
        text = report.to_json()
        try:
            write_report(report, self.config.report)
            where = self.config.report
        except OSError as exc:
            where = None
            _print_err(f"distdiag: cannot write the report to {self.config.report}: {exc.strerror}")
        self._write_junit(report)
        try:
            ex.publish("report", {"json": text, "host": self.info.host, "node": self.info.node})
        except Exception as exc:  # noqa: BLE001 - the local copy is written already
            log.warning("could not share the report through the store: %s", exc)
        self.progress.clear()
        if not show:
            pass
        elif self.config.format == "json":
            sys.stdout.write(text + "\n")
        elif self.config.quiet:
            sys.stdout.write(f"verdict: {report.verdict.upper()} (exit {report.exit_code}) - {report.summary}\n")
        else:
            sys.stdout.write(render_report(report, verbose=self.config.verbose) + "\n")
            if where:
                sys.stdout.write(f"report: {os.path.abspath(where)}\n")
        sys.stdout.flush()
        info = self.info
        ex.publish("verdict", {"exit_code": report.exit_code, "writer": info.rank, "host": info.host, "node": info.node})

    def _mirror(self, ex: Exchange, verdict: dict[str, Any]) -> None:
        """Local rank 0 of every other node writes the same report there."""
        # By node, not host: two torchrun agents on one machine are two nodes sharing a hostname.
        here = (self.info.host, self.info.node)
        if self.info.local_rank != 0 or (verdict.get("host"), verdict.get("node")) == here:
            return
        shared = ex.read("report")
        if shared and (shared.get("host"), shared.get("node")) != here:
            import json

            from distdiag.report.model import write_json_atomic

            write_json_atomic(self.config.report, shared["json"].rstrip("\n"))
            self._write_junit(Report.from_dict(json.loads(shared["json"])))

    def _write_junit(self, report: Report) -> None:
        if not self.config.junit:
            return
        from distdiag.report.junit import write_junit

        try:
            write_junit(report, self.config.junit)
        except OSError as exc:
            _print_err(f"distdiag: cannot write the JUnit XML to {self.config.junit}: {exc.strerror}")

    # -- the broken end (called on the sentinel thread of the rank that claims the writer) --
    def _write_abort_report(self, ex: Exchange, reason: dict[str, Any]) -> int:
        from distdiag.runtime.sentinel import kill_stopped_local, silent_rank_reasons

        world = self.info.world_size
        self._load_rank_infos(ex)
        snaps = {int(r): s for r, s in ex.collect("snap").items()}
        reasons = {int(r): v for r, v in ex.collect("abort_reason").items()}
        infos = {r: self.rank_infos[r] for r in range(world)}
        lost = silent_rank_reasons([r for r in range(world) if r not in snaps], infos, self.info.host)
        # Where did the run stop? The lowest step any live rank was still in.
        indices = [s["probe_index"] for s in snaps.values() if s.get("phase") in ("probe", "barrier")]
        final = all(s.get("phase") == "final" for s in snaps.values()) and snaps
        cur = min(indices) if indices else (len(self.plan.probes) if final else -1)
        results = self._completed(ex, max(cur, 0))
        if 0 <= cur < len(self.plan.probes):
            name = self.plan.probes[cur].probe.name
            posted = ex.collect(f"res/{cur}")
            errors = {r: p["error"] for r, p in posted.items() if p["status"] == "error" and not p.get("comm_error")}
            comm_errors = {r: {**p["error"], "comm": True} for r, p in posted.items() if p.get("comm_error")}
        else:
            name = "final" if final else "setup"
            errors = {int(r): e for r, e in ex.collect("setup_error").items()} if name == "setup" else {}
            comm_errors = {}
        # Exceptions a probe caught and went on from, posted the moment they were caught: when
        # they stranded the others, they lead (the rank itself may be waiting somewhere else now).
        for r, err in ex.collect(f"caught/{cur}").items():
            errors.setdefault(int(r), {**err, "caught": True})
        first = reasons.get(min(reasons)) if reasons else reason
        detail = first.get("detail", "") if first else ""
        if comm_errors and not lost:
            for r, err in comm_errors.items():
                errors.setdefault(r, err)
        kinds = {r.get("kind") for r in reasons.values()} or {reason.get("kind")}
        # Every rank that said why it stopped was told to by a signal, and none is lost or
        # raised: the run was cancelled (Ctrl-C, scancel, a preemption), nobody is at fault.
        cancelled = kinds == {"terminated"} and not lost and not errors
        duration = time.monotonic() - self.started
        if cancelled:
            result = cancel_result(name, snaps, world, reason=detail, duration_s=duration)
        else:
            result = hang_result(
                name, snaps, lost, errors, world, timeout_s=self.config.timeout_s, reason=detail, duration_s=duration,
            )
        results.append(result)
        not_run = [p.probe.name for p in self.plan.probes[cur + 1 :]] if cur >= 0 else self.plan.names
        outcome = (
            "cancelled" if cancelled
            else "lost_rank" if lost or "lost" in kinds
            else "stranded" if "stranded" in kinds
            else "deadline" if "deadline" in kinds
            else "hang" if "timeout" in kinds
            else "terminated"
        )
        report = self._report(results, not_run, outcome=outcome, hung=True, writer=self.info.rank)
        self._emit(report, ex)
        kill_stopped_local(lost, dict(enumerate(self.rank_infos)), self.info.host)
        return report.exit_code


def _bad_input(exc: ConfigError, argv: list[str], report_path: str = "distdiag-report.json") -> int:
    """Every rank prints the same line; rank 0 also leaves a report saying nothing ran."""
    _print_err(f"distdiag: error: {exc}")
    # Local rank 0 of every node leaves the report there (no shared filesystem assumed), so a
    # gate on any node reads exit code 2, not "no report" (3).
    if os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0":
        for i, arg in enumerate(argv):
            if arg == "--report" and i + 1 < len(argv):
                report_path = argv[i + 1]
            elif arg.startswith("--report="):
                report_path = arg.split("=", 1)[1]
        world = int(os.environ.get("WORLD_SIZE", "1") or 1) if os.environ.get("WORLD_SIZE", "1").isdigit() else 1
        report = Report(world_size=world, exit_code=EXIT_BAD_INPUT, verdict="error", outcome="bad_input", summary=str(exc))
        try:
            write_report(report, report_path)
        except OSError:
            pass
    _wait_for_peers_to_say_it()
    return EXIT_BAD_INPUT


def _wait_for_peers_to_say_it(wait_s: float = 10.0) -> None:
    """Leave only once every rank has printed its line.

    torchrun SIGTERMs the other workers about 0.1 s after the first one exits, so a rank that
    is still importing torch would die without a word; every rank checks in through the
    store first (bounded: a rank that never comes does not hold the others long).
    """
    from distdiag.runtime.context import LaunchInfo, connect_store

    try:
        info = LaunchInfo.from_env()
        if not info.distributed or info.world_size < 2:
            return
        ex = Exchange(connect_store(info, timedelta(seconds=wait_s)), info.rank, info.world_size)
        ex.post("bad_input", 1)
        ex.wait_count("bad_input", info.world_size, time.monotonic() + wait_s, poll_s=0.05)
    except Exception:  # noqa: BLE001 - best effort: the line is printed already
        return


def run_check(argv: list[str]) -> int:
    """Run the check on this rank; returns the exit code (the process should then end)."""
    from distdiag.runtime.context import LaunchInfo

    if any(a in ("-h", "--help") for a in argv):
        if os.environ.get("RANK", "0") == "0":
            from distdiag.check.plan import build_parser

            build_parser().print_help()
        return 0
    try:
        config = parse_config(argv)
        info = LaunchInfo.from_env()
        plan = make_plan(config, info.world_size)
        FaultPlan.from_env(info.rank)  # a malformed DISTDIAG_INJECT is bad input too
    except ConfigError as exc:
        return _bad_input(exc, argv)
    return CheckRun(config, plan, info).execute()


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m distdiag.check`: run, flush, leave with the verdict's code."""
    logging.basicConfig(
        level=logging.DEBUG if os.environ.get("DISTDIAG_DEBUG") == "1" else logging.WARNING,
        format="distdiag %(levelname)s %(name)s: %(message)s",
    )
    code = run_check(sys.argv[1:] if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: a hung collective on another thread of torch must not keep the process alive,
    # and interpreter teardown with torch loaded costs time for nothing.
    os._exit(code)
