"""HangWatchdog: the context manager users put around their training loop.

    with HangWatchdog(timeout=timedelta(minutes=5), dump_dir="hang-report") as wd:
        for step, batch in enumerate(loader):
            wd.step(step)                  # optional: optimizer steps are counted anyway
            train_step(batch)
            if step % 1000 == 0:
                with wd.phase("checkpoint", timeout=timedelta(minutes=20)):
                    save(...)

Arming (after init_process_group) starts one daemon thread, hooks torch's global optimizer
step (steps without marks) and, with `wrap=True`, wraps torch.distributed's Python
collectives for the arming thread; leaving the block - normally, by an exception, or at
interpreter exit - puts everything back. Nothing here touches signal handlers.

Where each rank is comes from torch's flight recorder (distdiag.hang.recorder): it must be on when
the process group is created - torch 2.13's default is on (2000 entries); elsewhere set
TORCH_FR_BUFFER_SIZE=2000 before init_process_group (`python -m distdiag.watch` does). Without
it the watchdog sees only the collectives its wrappers see (`wrap=True`): a rank waiting in
DDP's gradient all-reduce, a compiled graph's collectives or a queued NCCL kernel is
invisible, and such a hang is reported only when you mark steps (`wd.step`). The recorder's
stacks give call sites too (read once a hang is declared), so wrappers are off by default.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from distdiag.errors import ConfigError, HangDetected, error_summary, mentions_broken_connection
from distdiag.watchdog.config import WatchdogConfig
from distdiag.watchdog.watcher import VERDICT_STALL_S

__all__ = ["HangWatchdog"]

log = logging.getLogger("distdiag.watchdog")

_arms = [0]
"""How many watchdogs this process armed: all ranks arm in the same order, so the count
names the store namespace of this one (wd0/, wd1/, ...)."""


class HangWatchdog:
    """Names the stuck rank, its collective and its stack when a job stops making progress.

    Arguments left as None come from the environment (DISTDIAG_WATCHDOG_*), then defaults
    (WatchdogConfig documents each). By default torch.distributed's functions are left alone:
    hangs, call sites and a desync that hangs come from torch's flight recorder. `wrap=True`
    adds the step-mark fingerprints that find a silent desync while the job still runs.
    """

    def __init__(
        self,
        timeout: timedelta | None = None,
        *,
        action: str | None = None,
        dump_dir: str | None = None,
        poll: timedelta | None = None,
        history: int | None = None,
        wrap: bool | None = None,
        config: WatchdogConfig | None = None,
    ) -> None:
        if config is None:
            config = WatchdogConfig.from_env(
                timeout=timeout, action=action, dump_dir=dump_dir, poll=poll, history=history, wrap=wrap
            )
        self.config = config
        self._progress: Any = None
        self._interceptor: Any = None
        self._watcher: Any = None
        self._step_hook: Any = None
        self._loaders: Any = None
        self._groups: Any = None
        self._auto_step = 0

    # -- arming ---------------------------------------------------------------------------
    @property
    def armed(self) -> bool:
        return self._watcher is not None

    def start(self) -> HangWatchdog:
        import torch.distributed as dist

        from distdiag.runtime.context import LaunchInfo
        from distdiag.watchdog.groupnames import GroupLog
        from distdiag.watchdog.intercept import Interceptor
        from distdiag.watchdog.progress import Progress
        from distdiag.watchdog.watcher import Watcher

        if self.armed:
            return self
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "HangWatchdog needs the default process group: call torch.distributed.init_process_group() "
                "before entering it (or launch with python -m distdiag.watch)"
            )
        info = LaunchInfo.from_env()
        info.rank, info.world_size = dist.get_rank(), dist.get_world_size()
        self._warn_short_pg_timeout()
        index = _arms[0]
        _arms[0] += 1
        self._progress = Progress(self.config.history, threading.get_ident())
        self._interceptor = Interceptor(self._progress)
        if self.config.wrap is None:  # auto: wrappers only where the recorder cannot give call sites
            recorder = _recorder_gives_sites(info.rank)
            self.config = dataclasses.replace(self.config, wrap=not recorder)
            if recorder:
                # ...and for send/recv, whose peer the recorder does not keep (a pipeline stage
                # waiting in recv names whom it waits for); a few per step, not per collective
                self._interceptor.install(only_p2p=True)
        if self.config.wrap:
            self._interceptor.install()
        self._step_hook = _hook_optimizer_steps(self._progress)
        self._groups = GroupLog()
        if self._groups.install():
            self._progress.groups = self._groups
        self._tap_loaders()
        _warn_if_recorder_off(info.rank)
        _import_before_threads(symbolizer=not self.config.wrap)
        from distdiag.runtime import deathnote, lastword, settle

        deathnote.arm()  # a fatal signal leaves its stacks where same-host peers read them
        lastword.write_early(self.config.action != "report")  # a report-only verdict ends no run
        extra = {
            "timeout_s": self.config.timeout_s, "action": self.config.action, "dump_dir": self.config.dump_dir,
            "run_id": info.run_id, "restart_count": info.restart_count,
        }
        self._watcher = Watcher(
            progress=self._progress, config=self.config, info=info,
            store_factory=lambda: _store(info, index, self.config.timeout_s), extra_config=extra,
        )
        self._watcher.start()
        self._watcher.ready.wait(30)
        settle.idle_at_exit()  # gloo's workers idle before Python finalizes; runs after close (LIFO)
        atexit.register(self.close)
        return self

    def _tap_loaders(self) -> None:
        """Count DataLoader passes; each pass's end also goes beside the death note, so a rank
        aborted in the pass's end collective (uneven data) leaves its peers its loaders' word."""
        from distdiag.runtime.deathnote import note_loaders
        from distdiag.watchdog.dataload import LoaderTap

        self._loaders = LoaderTap(lambda: self._progress.steps, ended=note_loaders)
        if self._loaders.install():
            self._progress.loaders = self._loaders

    def close(self, error: BaseException | None = None) -> None:
        """Disarm: restore torch.distributed, stop the thread (bounded), post the final state."""
        if not self.armed:
            return
        watcher, self._watcher = self._watcher, None
        self._interceptor.restore()
        if self._groups is not None:
            self._groups.remove()
            self._groups = None
        if self._loaders is not None:
            self._loaders.remove()
            self._loaders = None
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        summary = None
        if error is not None and not isinstance(error, KeyboardInterrupt | SystemExit | HangDetected):
            summary = error_summary(error)
        if summary is not None and watcher.is_alive() and watcher.world > 1:
            if error is not None and _is_comm_error(error):  # summary is not None: neither is error
                # A peer died or broke its connection: the others learn it as an exception in
                # their collective. Report it (naming the lost rank) before the script goes on.
                summary["comm"] = True
                watcher.request("peer_error", summary)
            else:
                # This rank's exception may leave the others waiting in a collective it will
                # never enter: say so now, while they can still answer, then let it go on.
                watcher.request("raised", summary)
            _wait_acted(watcher, self.config.snapshot_grace.total_seconds() + VERDICT_STALL_S)
        watcher.finish(summary)
        if error is not None and not isinstance(error, KeyboardInterrupt | SystemExit):
            # the job ends with this exception (HangDetected under action 'raise', or the rank's
            # own error): a failing verdict reached meanwhile goes to torchrun's root cause too
            from distdiag.runtime.lastword import write_error_file

            write_error_file(1)
        from distdiag.runtime import deathnote

        deathnote.disarm()
        try:
            atexit.unregister(self.close)
        except Exception:  # noqa: BLE001 - interpreter shutting down
            pass

    def take_sigterm(self) -> bool:
        """Take SIGTERM for the report of a rank that died (distdiag/watchdog/sigterm.py says
        how and what is left alone); for the zero-code wrapper, which owns its process. Main
        thread only; True when taken."""
        from distdiag.watchdog.sigterm import TermWatch

        watcher = self._watcher
        if watcher is None:
            return False
        term = TermWatch()
        if not term.install(watcher.is_alive):
            return False
        watcher.term = term
        return True

    def ended_from_outside(self) -> bool:
        """SIGTERM reached this rank through take_sigterm, or a peer's `terminated` incident
        was handled here: an exception in the training thread now (a peer that left closed
        its connection) is a consequence, not news."""
        watcher = self._watcher
        if watcher is None:
            return False
        return bool(watcher.terminated_handled or (watcher.term is not None and watcher.term.received.is_set()))

    def leave_ended(self) -> None:
        """End a rank ended_from_outside without its training thread's traceback: the watchdog
        thread ends it once the incident is handled (exit 3 after a report); otherwise 143."""
        from distdiag.runtime.sentinel import flush_and_exit
        from distdiag.watchdog.sigterm import EXIT_SIGTERM, TERM_GRACE_S

        watcher = self._watcher
        if watcher is not None and watcher.term is not None and watcher.term.received.is_set():
            watcher.join(TERM_GRACE_S)  # it calls flush_and_exit itself
        flush_and_exit(EXIT_SIGTERM)

    def __enter__(self) -> HangWatchdog:
        return self.start()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.close(exc)

    # -- progress marks --------------------------------------------------------------------
    def step(self, step: Any = None) -> None:
        """Mark the start of a training step (progress; ranks compare their collectives here)."""
        if self._progress is None:
            return
        if step is None:
            step = self._auto_step
            self._auto_step += 1
        self._progress.mark_step(step)

    @contextmanager
    def phase(self, name: str, timeout: timedelta | None = None) -> Iterator[None]:
        """Long work without collectives (checkpoint, evaluation) with its own time budget.

        Peers waiting on this rank are not declared hung while the budget lasts.
        """
        if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
            raise ConfigError(f"watchdog phase '{name}': timeout must be a positive timedelta, got {timeout!r}")
        budget = (timeout or self.config.timeout).total_seconds()
        if self._progress is None:
            yield
            return
        self._progress.enter_phase(name, budget)
        try:
            yield
        finally:
            self._progress.exit_phase()

    # -- helpers ---------------------------------------------------------------------------
    def _warn_short_pg_timeout(self) -> None:
        pg_timeout = default_pg_timeout()
        if pg_timeout is not None and pg_timeout < self.config.timeout:
            log.warning(
                "the default process group's timeout (%gs) is shorter than the watchdog's (%gs): torch will end a "
                "hung collective first and the watchdog will not report it; pass timeout=timedelta(seconds=%d) or "
                "more to init_process_group, or lower the watchdog's timeout",
                pg_timeout.total_seconds(), self.config.timeout_s, int(self.config.timeout_s * 2),
            )


def _hook_optimizer_steps(progress: Any) -> Any:
    """torch's global optimizer step post-hook counts steps with no code change (None if absent)."""
    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook
    except ImportError:  # pragma: no cover - every torch >= 2.0 has it
        return None
    return register_optimizer_step_post_hook(progress.optimizer_step)


def _recorder_gives_sites(rank: int) -> bool:
    """Whether torch's flight recorder is on and has a stack dump (the call sites' source when
    the collectives are not wrapped); rank 0 says so when it falls back to the wrappers."""
    import torch

    from distdiag.hang.recorder import EngineReader, recorder_enabled

    c10d = getattr(torch._C, "_distributed_c10d", None)
    stacks = any(hasattr(c10d, name) for name in ("_dump_fr_trace", "_dump_nccl_trace"))
    ok = EngineReader().available and recorder_enabled() and stacks
    if not ok and rank == 0:
        log.info("distdiag watchdog: torch's flight recorder gives no call sites here: wrapping torch.distributed's "
                 "collectives for them (pass wrap=False to leave them alone)")
    return ok


_THREAD_MODULES = (
    "distdiag.hang.dumps", "distdiag.hang.rules", "distdiag.hang.views", "distdiag.hang.dumpreport",
    "distdiag.runtime.sentinel", "distdiag.report.model", "distdiag.watchdog.sigterm", "distdiag.watchdog.writer",
    "copy", "dataclasses", "traceback",
)
"""What the watchdog's threads import lazily (a snapshot, an incident, a report)."""


def _import_before_threads(symbolizer: bool) -> None:
    """Everything the watchdog's threads will use, imported here, on the training thread,
    before they start: a thread of ours that imports while the training thread does can hand
    the user's code a partially initialised module (see distdiag.hang.recorder.SYMBOLIZER).
    `symbolizer`: call sites will come from the recorder's stacks (about 0.9 s of CPU, once)."""
    import importlib

    from distdiag.hang.recorder import load_symbolizer

    for name in _THREAD_MODULES:
        importlib.import_module(name)
    if symbolizer:
        load_symbolizer()


def _warn_if_recorder_off(rank: int) -> None:
    from distdiag.hang.recorder import EngineReader, recorder_enabled

    reader = EngineReader()
    if rank != 0:
        return
    if not reader.available:
        log.warning("distdiag watchdog: %s; it sees only the collectives its wrappers see", reader.reason)
    elif not recorder_enabled():
        log.warning(
            "distdiag watchdog: torch's flight recorder is off (TORCH_FR_BUFFER_SIZE=0): collectives torch issues "
            "itself (DDP's gradient all-reduce, FSDP, compiled graphs, NCCL) are invisible; set "
            "TORCH_FR_BUFFER_SIZE=2000 before init_process_group"
        )


def _is_comm_error(exc: BaseException) -> bool:
    return type(exc).__name__ == "DistNetworkError" or mentions_broken_connection(exc)


def default_pg_timeout() -> timedelta | None:
    """The default group's collective timeout, as its backend holds it (None if unknown)."""
    import torch
    from torch.distributed import distributed_c10d as c10d

    try:
        pg = c10d._get_default_group()
    except Exception:  # noqa: BLE001
        return None
    for device in ("cuda", "cpu"):
        try:
            backend = pg._get_backend(torch.device(device))
            timeout = backend.options._timeout
        except Exception:  # noqa: BLE001 - no backend for that device
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return None


def _wait_acted(watcher: Any, bound_s: float) -> None:
    """Until the watcher acted on the event this rank's exception declared: at most `bound_s`
    for it to start, then as long as it is inside the incident (its own waits are bounded by
    the writer's progress, distdiag/runtime/incident.py)."""
    end = time.monotonic() + bound_s
    while not watcher.acted.wait(0.1):
        if not watcher.is_alive() or (time.monotonic() > end and not watcher.in_incident.is_set()):
            return


def _store(info: Any, index: int, timeout_s: float) -> Any:
    """A store client for the watchdog thread, under the run's prefix and this arming's."""
    import torch.distributed as dist

    from distdiag.runtime.context import connect_store

    prefix = f"wd{index}/"
    if info.agent_store and info.distributed:
        # torchrun's agent (or our test harness) hosts the store: a client of our own.
        return connect_store(info, timedelta(seconds=max(30.0, timeout_s)), prefix=prefix)
    # Without an agent store the job's store lives in rank 0's init; share that client.
    base = dist.distributed_c10d._get_default_store()
    return dist.PrefixStore(info.key_prefix + prefix, base)
