"""`torchrun --nproc-per-node N -m distdiag.check`: run the probes, print one verdict, exit.

Flow on every rank: parse and validate (bad input -> one line, exit 2), connect to the job's
store, start the sentinel, init the process groups, then for each probe: run it, post the
result to the store, wait until every rank posted. Rank 0 consolidates, writes the report,
prints the table and publishes the verdict (distdiag.check.finish); every rank exits with the
verdict's code after the report is written. When a rank hangs, dies or raises, the sentinels
end the run instead (distdiag.runtime.sentinel) and one of them writes the report.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from distdiag.check.config import CheckConfig
from distdiag.check.finish import RunEnd
from distdiag.check.plan import Plan, make_plan, parse_config, validate_injection
from distdiag.check.shared_values import share_fields
from distdiag.check.starting import signalled_while_importing
from distdiag.errors import ConfigError, error_summary, mentions_broken_connection, print_line
from distdiag.launcher.ranks import note_phase
from distdiag.report.model import EXIT_BAD_INPUT, EXIT_HANG, ProbeResult, RankInfo
from distdiag.report.render import ProgressLine
from distdiag.runtime.exchange import Exchange, bounded, poll_interval
from distdiag.runtime.faults import FaultPlan
from distdiag.runtime.keys import Keys

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from distdiag.check.plan import PlannedProbe
    from distdiag.check.target import Target
    from distdiag.runtime.context import LaunchInfo, RankContext

__all__ = ["main", "run_check"]

log = logging.getLogger("distdiag.check")

VERDICT_WAIT_SLICE_S = 20.0
"""One blocking wait for the verdict (below STORE_STALL_S, distdiag/runtime/exchange.py: a wait
longer than that reads as a frozen store)."""
ACK_WAIT_S = 3.0
"""Rank 0, after publishing the verdict: how long it waits for the others to acknowledge it
before everyone leaves (LEAVE_WAIT_S, in distdiag.check.finish, bounds the leaving)."""
CHECKIN_MIN_S = 60.0


def checkin_limit(timeout_s: float) -> float:
    """How long ranks wait for every rank to check in: torch's import takes seconds per rank on
    a loaded node, whatever --timeout-s says; never less than the probe deadline."""
    return max(timeout_s, CHECKIN_MIN_S)


def _is_comm_error(exc: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(exc, getattr(dist, "DistError", ())) or mentions_broken_connection(exc)


def _import_planned_probes(plan: Plan) -> None:
    """Import what the planned probes import (their `preload`) now, under the check-in's long
    limit, not inside the first probe's deadline: on a loaded node a rank's first import of the
    built-in workloads took longer than a probe's timeout, and a healthy check was reported as a
    hang. Ranks forked by `distdiag check` have them already (no cost). An import that fails is
    left to the probe, which reports it."""
    import importlib

    for planned in plan.probes:
        if planned.skip_reason is not None:
            continue
        for name in type(planned.probe).preload:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the probe imports it again and says why it failed
                pass


class CheckRun:
    """One rank's run of the plan: set up, run the probes under deadlines, reach the end
    (distdiag.check.finish.RunEnd writes the report and leaves)."""

    def __init__(self, config: CheckConfig, plan: Plan, info: LaunchInfo) -> None:
        from distdiag.runtime.tracker import Tracker

        self.config = config
        self.plan = plan
        self.info = info
        self.tracker = Tracker()
        self.tracker.enter_phase("checkin")
        self.faults = FaultPlan.from_env(info.rank)
        self.started = time.monotonic()
        self.results: list[ProbeResult] = []
        self._caught_posted: set[int] = set()
        self.progress = ProgressLine.for_check(config, info.rank)  # rank 0 on a terminal only (render.py)
        self.end = RunEnd(config, plan, info, self.started, self.progress)

    # -- store and sentinel ---------------------------------------------------------------
    def _store(self) -> dist.Store:
        from distdiag.runtime.context import connect_store

        with bounded("connect"):  # the sentinel's own client, made while the host may be frozen
            return connect_store(self.info, timedelta(seconds=max(30.0, self.config.timeout_s)))

    def execute(self) -> int:
        import torch

        from distdiag.runtime.comm import Comm
        from distdiag.runtime.context import RankContext, pick_device
        from distdiag.runtime.sentinel import install_sigterm_wakeup

        info = self.info
        install_sigterm_wakeup()
        note_phase("connecting to the job's store")
        if not self._connect():
            return EXIT_HANG
        setup_exc, device_error = None, None
        try:
            device, backend = pick_device(info, self.config.backend)
        except ConfigError as exc:  # more local ranks than GPUs: bad input, said by every rank (below)
            device, backend = torch.device("cpu"), "gloo"
            device_error = str(exc)
        except Exception as exc:  # noqa: BLE001 - a broken GPU: report it, do not just die
            device, backend = torch.device("cpu"), "gloo"
            setup_exc = exc
        self._start_sentinel()
        if signalled_while_importing(self.sentinel, info.rank):
            self._park()  # the sentinel ends the run, before this rank checks in
        if setup_exc is not None:
            self._setup_failed(setup_exc, "could not select its device")

        note_phase("checking in (waiting for every rank to reach the store)")
        _import_planned_probes(self.plan)
        self.ex.post(Keys.INFO, RankInfo(info.rank, info.host, info.node, info.local_rank, str(device), info.pid).to_dict())
        self._wait_for_checkin()
        if info.rank == 0:  # the writer of the normal end: each probe consolidated as it completes
            self.end.consolidate_ahead(self.ex, self._store)
        note_phase("setting up (the target, the process groups)")
        self.tracker.enter_phase("setup")
        target = self._load_target_everywhere(device_error)
        side_group = self._init_process_groups(backend, device)
        torch.manual_seed(1234)
        ctx = RankContext(
            info=info, device=device, backend=backend, tracker=self.tracker,
            comm=Comm(self.tracker, self.faults), store=self.store, side_group=side_group, faults=self.faults,
            target=target,
        )
        for index, planned in enumerate(self.plan.probes):
            self._run_probe(ctx, index, planned)
        return self._finish()

    def _connect(self) -> bool:
        """Reach the job's store (False, with one line said, when it cannot be reached: nothing
        can be reported without it) and publish caught exceptions through it."""
        info = self.info
        try:
            self.store = self._store()
        except Exception as exc:  # noqa: BLE001 - nothing can be reported without the store
            where = f"{info.master_addr}:{info.master_port}" if info.distributed else "in-process"
            print_line(f"distdiag[rank {info.rank}]: cannot reach the job's store at {where}: {exc}")
            return False
        from distdiag.runtime.exchange import bound_store_calls
        from distdiag.runtime.sentinel import flush_and_exit

        # A stopped or frozen store host answers no call, whatever the store's timeout.
        bound_store_calls(info.rank, lambda: flush_and_exit(EXIT_HANG))
        self.ex = Exchange(self.store, info.rank, info.world_size)
        from distdiag.errors import set_caught_publisher

        set_caught_publisher(self._publish_caught)
        return True

    def _start_sentinel(self) -> None:
        """Start this rank's sentinel (it ends the run when a rank hangs, dies or raises)."""
        from distdiag.runtime import deathnote
        from distdiag.runtime.incident import Seat
        from distdiag.runtime.sentinel import Sentinel

        deathnote.arm()  # a fatal signal leaves its stack where a same-host peer's report reads it
        info, cfg = self.info, self.config
        self.sentinel = Sentinel(
            store_factory=self._store,
            rank=info.rank,
            world_size=info.world_size,
            seat=Seat.of(info),
            tracker=self.tracker,
            timeout_s=cfg.timeout_s,
            setup_timeout_s=checkin_limit(cfg.timeout_s),
            deadline_at=self.started + cfg.deadline_s,
            write_abort_report=self.end.write_abort_report,
            mirror=self.end.mirror,
            on_abort=self.progress.clear,
        )
        self.end.sentinel = self.sentinel
        self.sentinel.start()
        self.sentinel.started_ok.wait(30)

    def _setup_failed(self, exc: BaseException, what: str) -> NoReturn:
        """This rank could not set up (`what` it could not do): post why, end the run."""
        self.ex.post(Keys.SETUP_ERROR, error_summary(exc))
        self.sentinel.trigger("setup", f"rank {self.info.rank} {what}: {type(exc).__name__}")
        self._park()

    def _init_process_groups(self, backend: str, device: torch.device) -> dist.ProcessGroup | None:
        """Init the main process group and the side group; returns the side group."""
        from distdiag.hang.recorder import enable_recorder
        from distdiag.runtime.context import init_process_groups

        # Before init: the recorder's buffer is sized when a process group is created. It is
        # how a hang report sees collectives torch issues itself (DCP, FSDP, hooks).
        enable_recorder(2000)
        try:
            self.faults.at("setup", 0)
            return init_process_groups(
                self.info, self.store, backend, device, timedelta(seconds=self.config.deadline_s + 60)
            )
        except Exception as exc:  # noqa: BLE001 - e.g. an NCCL or device error: a finding, not a traceback
            self._setup_failed(exc, "could not init the process group")

    def _wait_for_checkin(self) -> None:
        """Every rank posts its row of the rank table once it has imported torch and reached the
        store; ranks start seconds apart on a loaded node, so this wait alone has the longer
        limit. A rank that never checks in is named as such, not as lost on host '?'."""
        limit = checkin_limit(self.config.timeout_s)
        world = self.info.world_size
        if not self.ex.wait_count(Keys.INFO, world, time.monotonic() + limit, poll_s=0.05, stop=self.sentinel.aborting.is_set):
            if not self.sentinel.aborting.is_set():
                missing = sorted(set(range(world)) - set(self.ex.present(Keys.INFO)))
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
        self.ex.post(Keys.caught(index), summary)

    def _load_target_everywhere(self, device_error: str | None = None) -> Target | None:
        """Load the user's target on every rank; if any rank fails, every rank exits 2.

        A target can fail on one node only (a file missing there), so ranks agree through the
        store before anyone initialises a process group that the failed rank would never join.
        A rank that could not be given a device of its own (`device_error`: more local ranks
        than GPUs) is bad input the same way, agreed in the same exchange.
        """
        from distdiag.check.target import load_target

        error = device_error
        target = None
        if self.config.target and error is None:
            try:
                target = load_target(self.config.target)
            except ConfigError as exc:
                error = str(exc)
        self.ex.post(Keys.VALID, error)
        limit = self.config.timeout_s
        if not self.ex.wait_count(Keys.VALID, self.info.world_size, time.monotonic() + limit):
            missing = sorted(set(range(self.info.world_size)) - set(self.ex.collect(Keys.VALID)))
            self.sentinel.trigger("setup", f"ranks {missing} did not finish loading the target within {limit:g}s")
            self._park()
        errors = {r: e for r, e in self.ex.collect(Keys.VALID).items() if e}
        if errors:
            first = min(errors)
            where = "" if len(errors) == self.info.world_size else f" (on rank {first})"
            bad = ConfigError(f"{errors[first]}{where}")
            self.sentinel.finishing_code = EXIT_BAD_INPUT
            code = _bad_input(bad, [], report_path=self.config.report)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return target

    def _run_probe(self, ctx: RankContext, index: int, planned: PlannedProbe) -> None:
        probe = planned.probe
        note_phase(f"in probe '{probe.name}'")
        self.progress.show(index, len(self.plan.probes), probe.name)
        if probe.times_ranks and self.end.ahead is not None:
            self.end.ahead.drain()  # no other thread of rank 0 holding the GIL while it is timed
        self.tracker.enter_phase("probe", index, probe.name)
        started = time.perf_counter()
        entry = self._probe_entry(ctx, planned)
        entry["duration_s"] = round(time.perf_counter() - started, 4)
        self.tracker.enter_phase("barrier", index, probe.name)
        self._post_and_wait(index, probe.name, share_fields(self.ex, index, entry, probe.shared_fields))
        if self.end.ahead is not None:
            self.end.ahead.ready(index)

    def _probe_entry(self, ctx: RankContext, planned: PlannedProbe) -> dict[str, Any]:
        """What this rank posts for one probe: skipped and why, its payload, or its error."""
        probe = planned.probe
        if planned.skip_reason:
            return {"status": "skip", "reason": planned.skip_reason}
        ctx.options = planned.options
        try:
            reason = probe.missing_api_reason() or probe.skip_reason(ctx)
            if reason:
                return {"status": "skip", "reason": reason}
            self.faults.at(probe.name, 0)
            return {"status": "ok", "payload": probe.run(ctx)}
        except Exception as exc:  # noqa: BLE001 - a probe's exception is a finding
            return {"status": "error", "error": error_summary(exc), "comm_error": _is_comm_error(exc)}

    def _post_and_wait(self, index: int, name: str, entry: dict[str, Any]) -> None:
        """Post this rank's entry for probe `index` and wait until every rank posted; a broken
        connection, or a rank that raised while others did not finish, ends the run."""
        key = Keys.result(index)
        self.ex.post(key, entry)
        if entry["status"] == "error":
            self.ex.bump(Keys.errors(index))
            if entry.get("comm_error"):
                self.ex.bump(Keys.comm_errors(index))
        posted = time.monotonic()
        # Half the probe deadline: ranks that raise at different times (one computes
        # longer) must not be taken for ranks stranded in a collective.
        grace = self.config.timeout_s / 2
        # The error counters are read once a slice; a large world polls less often (issue 21:
        # 16k ranks polling every 10 ms, and reading two counters every 0.25 s, would take
        # several cores of torchrun's store), so a slice spans 8 of its polls there.
        world = self.info.world_size
        slice_s = max(0.25, 8 * poll_interval(0.01, world))
        # Rank 0 alone polls at the wait's own 10 ms: it consolidates each probe the moment the
        # last rank posted it (distdiag/check/ahead.py), the last one before the verdict.
        writer = self.info.rank == 0
        while not self.ex.wait_count(key, world, time.monotonic() + slice_s, stop=self.sentinel.aborting.is_set, alone=writer):
            if self.sentinel.aborting.is_set():
                self._park()
            if self.ex.bump(Keys.comm_errors(index), 0) > 0:
                self.sentinel.trigger("lost", f"a rank lost its connection to a peer during probe '{name}'")
                self._park()
            if time.monotonic() - posted > grace and self.ex.bump(Keys.errors(index), 0) > 0:
                self.sentinel.trigger("stranded", f"probe '{name}' raised on a rank; others did not finish")
                self._park()
        if self.ex.bump(Keys.comm_errors(index), 0) > 0:
            # Every rank answered, but a connection broke: the main group is unusable now.
            self.sentinel.trigger("lost", f"a connection between ranks broke during probe '{name}'")
            self._park()

    def _park(self) -> NoReturn:
        """The sentinel is ending the run: wait for it to exit the process."""
        self.sentinel.aborting.wait(self.config.deadline_s)
        time.sleep(self.config.timeout_s + 60)
        print_line(f"distdiag[rank {self.info.rank}]: the sentinel did not end the run; exiting 3")
        os._exit(EXIT_HANG)

    # -- the normal end --------------------------------------------------------------------
    def _finish(self) -> int:
        """After the last probe: rank 0 consolidates, writes the report and publishes the
        verdict; the others wait for it and acknowledge; then every rank leaves together."""
        info = self.info
        note_phase("reaching the verdict")
        self.tracker.enter_phase("final")
        self.faults.at("final", 0)
        if info.rank == 0:
            if self.ex.count(Keys.ABORT_REASON) > 0 or not self.end.incident(self.ex).claim_writer("main"):  # a rank ends it
                self._park()
            report = self.end.consolidate(self.ex)
            self.end.emit(report, self.ex)
            self.end.verdict_report = report
            self.sentinel.finishing_code = report.exit_code
            self.sentinel.on_late_sigterm = lambda: self.end.after_verdict(self.sentinel.exchange or self.ex, wait_s=0.5)
            self.ex.wait_count(Keys.ACK, info.world_size - 1, time.monotonic() + ACK_WAIT_S)
            return self.end.after_verdict(self.ex)
        verdict = self.end.incident(self.ex).wait_published(VERDICT_WAIT_SLICE_S, self.sentinel.aborting.is_set)
        if verdict is None:  # a rank aborted meanwhile: the sentinel ends the run
            self._park()
        code = verdict.exit_code
        # This node's copy first: once finishing_code is set, a SIGTERM from torchrun (another
        # local rank already left non-zero) ends this process at once.
        self.end.mirror(self.ex, verdict)
        self.sentinel.finishing_code = code
        self.ex.post(Keys.ACK, 1)
        self.end.after_verdict(self.ex)
        return code


def _bad_input(exc: ConfigError, argv: list[str], report_path: str | None = None) -> int:
    """Every rank prints the same line; rank 0 also leaves a report saying nothing ran."""
    from distdiag.launcher.ranks import note_verdict, report_path_in, write_bad_input_report

    print_line(f"distdiag: error: {exc}")
    # Local rank 0 of every node leaves the report there (no shared filesystem assumed), so a
    # gate on any node reads exit code 2, not "no report" (3).
    if os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0":
        world = int(os.environ.get("WORLD_SIZE", "1") or 1) if os.environ.get("WORLD_SIZE", "1").isdigit() else 1
        written = write_bad_input_report(str(exc), report_path or report_path_in(argv), world)
        note_verdict(EXIT_BAD_INPUT, written)
    _wait_for_peers_to_say_it()
    return EXIT_BAD_INPUT


def _wait_for_peers_to_say_it(wait_s: float = 10.0) -> None:
    """Leave only once every rank has printed its line.

    torchrun SIGTERMs the other workers about 0.1 s after the first one exits, so a rank that
    is still importing torch would die without a word; every rank checks in through the
    store first (bounded: a rank that never comes does not hold the others long).

    The store calls run on a daemon thread joined for `wait_s` plus a margin: a c10d client
    waits forever for a store host that is stopped or frozen, whatever its timeout
    (distdiag/runtime/exchange.py), and bad input must still end in exit 2 within seconds.
    When the thread is still stuck, this process leaves at once with exit 2 (its line is
    printed already; a normal exit would wait on the store client's teardown).
    """
    done = threading.Event()
    thread = threading.Thread(target=_say_it_through_the_store, args=(wait_s, done), name="distdiag-bad-input", daemon=True)
    thread.start()
    if not done.wait(wait_s + BAD_INPUT_STORE_MARGIN_S):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_BAD_INPUT)


BAD_INPUT_STORE_MARGIN_S = 5.0
"""How much longer than its own wait a rank with bad input waits on a store that does not answer."""


def _say_it_through_the_store(wait_s: float, done: threading.Event) -> None:
    from distdiag.runtime.context import LaunchInfo, connect_store

    try:
        info = LaunchInfo.from_env()
        if not info.distributed or info.world_size < 2:
            return
        ex = Exchange(connect_store(info, timedelta(seconds=wait_s)), info.rank, info.world_size)
        ex.post(Keys.BAD_INPUT, 1)
        ex.wait_count(Keys.BAD_INPUT, info.world_size, time.monotonic() + wait_s, poll_s=0.05)
    except Exception:  # noqa: BLE001 - best effort: the line is printed already
        return
    finally:
        done.set()


def run_check(argv: list[str]) -> int:
    """Run the check on this rank; returns the exit code (the process should then end)."""
    from distdiag.runtime.context import LaunchInfo

    if any(a in ("-h", "--help") for a in argv):
        if os.environ.get("RANK", "0") == "0":
            from distdiag.check.plan import build_parser

            build_parser().print_help()
        return 0
    from distdiag.check.leftovers import note_start

    note_start()
    try:
        config = parse_config(argv)
        # Fixed now, before the user's target runs: a target that changes directory at import
        # must not send the report (or the JUnit XML) where nobody looks for it.
        config.report = os.path.abspath(config.report)
        config.junit = os.path.abspath(config.junit) if config.junit else config.junit
        info = LaunchInfo.from_env()
        plan = make_plan(config, info.world_size)
        validate_injection(info.world_size)  # a malformed DISTDIAG_INJECT is bad input too
    except ConfigError as exc:
        return _bad_input(exc, argv)
    except SystemExit as exc:  # argparse's --version: the only exit of ours before the run
        return exc.code if isinstance(exc.code, int) else 0
    return CheckRun(config, plan, info).execute()


def main(argv: list[str] | None = None, *, forked: bool = False) -> None:
    """Entry point of `python -m distdiag.check`: run, flush, leave with the verdict's code.

    `forked`: this rank was forked by distdiag.launcher.forkrun (torch's multiprocessing worker):
    on a pass it returns, so that torch's worker wrapper hands the agent its result (a worker
    that leaves with code 0 without one leaves the agent waiting forever); any other code
    leaves at once, as in a rank of its own.
    """
    logging.basicConfig(
        level=logging.DEBUG if os.environ.get("DISTDIAG_DEBUG") == "1" else logging.WARNING,
        format="distdiag %(levelname)s %(name)s: %(message)s",
    )
    try:
        code = run_check(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:
        # sys.exit from the user's target or hook: the check never reached its verdict, so
        # leaving with the code asked for (0, often) would pass for a passing rank.
        print_line(f"distdiag[rank {os.environ.get('RANK', '0')}]: the check was ended by sys.exit({exc.code!r}) "
                   "from inside (the target?) before its verdict; exiting 3")
        code = EXIT_HANG
    from distdiag.launcher.ranks import forget_phase
    from distdiag.runtime import deathnote
    from distdiag.runtime.lastword import write_error_file

    deathnote.disarm()  # ending normally: no fatal signal to tell
    forget_phase()  # and no phase note to leave (plain torchrun; the launcher removes its own)
    write_error_file(code)  # the verdict's sentence for torchrun's root cause (runtime/lastword.py)
    sys.stdout.flush()
    sys.stderr.flush()
    if forked and code == 0:
        from distdiag.check.leftovers import leave_without_joining

        # torch's worker wrapper leaves through os._exit too, once the agent has the result;
        # without waiting for the user's threads (distdiag/check/leftovers.py).
        leave_without_joining(code)
        return
    # os._exit: a hung collective on another thread of torch must not keep the process alive,
    # and interpreter teardown with torch loaded costs time for nothing.
    os._exit(code)
