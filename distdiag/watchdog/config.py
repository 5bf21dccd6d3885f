"""The watchdog's options: one typed dataclass, the environment knobs that set the same fields.

Library callers pass `timedelta`s; the zero-code wrapper and the environment use seconds
(`--timeout-s`, DISTDIAG_WATCHDOG_TIMEOUT_S). An explicit argument wins over the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

from distdiag.errors import ConfigError
from distdiag.report.model import EXIT_HANG

__all__ = [
    "ACTIONS",
    "WatchdogConfig",
    "WATCHDOG_TIMEOUT_S",
    "WATCHDOG_ACTION",
    "WATCHDOG_DUMP_DIR",
    "WATCHDOG_FLIGHT_RECORDER",
    "WATCHDOG_NCCL_TIMING",
    "WATCHDOG_HISTORY",
    "WATCHDOG_WRAP",
    "WATCHDOG_COMPILE_TIMEOUT_S",
    "WATCHDOG_STARTUP_TIMEOUT_S",
    "EXIT_WATCHDOG",
    "MAX_TIMEOUT_S",
]

WATCHDOG_TIMEOUT_S = "DISTDIAG_WATCHDOG_TIMEOUT_S"
"""Seconds without progress on a rank before it is declared hung (default 300)."""
WATCHDOG_ACTION = "DISTDIAG_WATCHDOG_ACTION"
"""abort | raise | report (default abort)."""
WATCHDOG_DUMP_DIR = "DISTDIAG_WATCHDOG_DUMP_DIR"
"""Where the writing rank puts hang-report.json (default ./hang-report)."""
WATCHDOG_FLIGHT_RECORDER = "DISTDIAG_WATCHDOG_FLIGHT_RECORDER"
"""Entries of torch's flight recorder the wrapper enables before init (0: leave it off)."""
WATCHDOG_NCCL_TIMING = "DISTDIAG_WATCHDOG_NCCL_TIMING"
"""1: also record NCCL's start events (TORCH_NCCL_ENABLE_TIMING=1) with the flight recorder; default off."""
WATCHDOG_HISTORY = "DISTDIAG_WATCHDOG_HISTORY"
"""How many collective fingerprints each rank keeps for the desync analysis (default 512)."""
WATCHDOG_WRAP = "DISTDIAG_WATCHDOG_WRAP"
"""1 or 0: wrap torch.distributed's Python collectives (live desync fingerprints at step marks);
unset: only where torch's flight recorder gives no call sites."""
WATCHDOG_COMPILE_TIMEOUT_S = "DISTDIAG_WATCHDOG_COMPILE_TIMEOUT_S"
"""Budget in seconds of a torch.compile compilation, a phase of its own (default 1800)."""
WATCHDOG_STARTUP_TIMEOUT_S = "DISTDIAG_WATCHDOG_STARTUP_TIMEOUT_S"
"""Budget in seconds of a job's start: a rank not checked in yet, an import (default 600)."""

ACTIONS = ("abort", "raise", "report")

MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""A week: longer timeouts are a typo (1e300 used to reach the store as an int and kill every rank)."""

EXIT_WATCHDOG = EXIT_HANG
"""The exit code of a process the watchdog ends (the same as the check's "hang or rank lost")."""


def _env_float(name: str) -> float | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name} must be a number of seconds, got {raw!r}") from None


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name} must be an integer, got {raw!r}") from None


@dataclass
class WatchdogConfig:
    """How the hang watchdog decides and what it does."""

    timeout: timedelta = timedelta(minutes=5)
    """No progress (no collective completing, no step mark) for this long on a rank is a hang."""
    action: str = "abort"
    """abort: report, then end every reachable rank (exit 3); raise: raise HangDetected in the
    training thread where possible (a rank blocked in a gloo collective cannot be interrupted
    and is aborted); report: write the report and let the job carry on."""
    dump_dir: str = "hang-report"
    """Directory on the writing rank's host for hang-report.json (other hosts get a copy)."""
    poll: timedelta | None = None
    """How often the watchdog thread looks; default min(0.5 s, timeout / 8)."""
    history: int = 512
    """Collective fingerprints kept per rank for the desync analysis (bounded memory)."""
    snapshot_grace: timedelta = timedelta(seconds=2)
    """How long the writer waits for live ranks' snapshots once a hang is declared."""
    compare_steps: bool = True
    """Compare ranks' collective fingerprints at each step mark (finds silent desyncs)."""
    wrap: bool | None = None
    """Wrap torch.distributed's Python collectives while armed. None (the default): all of them
    only where torch's flight recorder is off or has no stack dump (torch < 2.7 on gloo), else
    only send/recv (the recorder keeps no peer). Torch's flight
    recorder shows every rank's position, and its stack dump (read at snapshot time) gives
    each recorded collective's call site, so a hang report names the lines and a desync that
    hangs is located without them. The wrappers add the step-mark fingerprints that find a
    silent desync (a skipped or extra same-shape call gloo/NCCL paired with the next one)
    while the job still runs, the op as the user called it (gloo records reduce_scatter as
    all_reduce; a broadcast's root), send/recv peers, and call sites where the recorder is
    off or too old. About 8 us of Python per wrapped collective (docs/watchdog.md)."""
    compile_timeout: timedelta = timedelta(minutes=30)
    """torch.compile's compilation is a phase with this budget: peers waiting for a rank that
    (re)compiles are not hung until it runs out."""
    startup_timeout: timedelta = timedelta(minutes=10)
    """A job still starting is not hung: for this long after arming, peers wait for a rank
    whose watchdog has not checked in yet, and an import (torch loads parts of itself lazily,
    slow on a busy CPU) is a phase of this budget."""

    def __post_init__(self) -> None:
        if not isinstance(self.timeout, timedelta) or not 0 < self.timeout.total_seconds() <= MAX_TIMEOUT_S:
            raise ConfigError(f"watchdog.timeout must be a positive timedelta of at most a week, got {self.timeout!r}")
        if self.action not in ACTIONS:
            raise ConfigError(f"watchdog.action must be one of {', '.join(ACTIONS)}, got {self.action!r}")
        if not isinstance(self.dump_dir, str | os.PathLike) or not str(self.dump_dir):
            raise ConfigError(f"watchdog.dump_dir must be a non-empty path, got {self.dump_dir!r}")
        self.dump_dir = str(self.dump_dir)
        if self.poll is not None and not 0.001 <= self.poll.total_seconds() <= 60:
            raise ConfigError(f"watchdog.poll must be within [1 ms, 60 s], got {self.poll}")
        if not 16 <= int(self.history) <= 100_000:
            raise ConfigError(f"watchdog.history must be within [16, 100000], got {self.history}")
        if self.snapshot_grace.total_seconds() < 0:
            raise ConfigError(f"watchdog.snapshot_grace must be >= 0, got {self.snapshot_grace}")
        if self.wrap is not None and not isinstance(self.wrap, bool):
            raise ConfigError(f"watchdog.wrap must be True, False or None (auto), got {self.wrap!r}")
        if not isinstance(self.compile_timeout, timedelta) or self.compile_timeout.total_seconds() <= 0:
            raise ConfigError(f"watchdog.compile_timeout must be a positive timedelta, got {self.compile_timeout!r}")
        if not isinstance(self.startup_timeout, timedelta) or self.startup_timeout.total_seconds() <= 0:
            raise ConfigError(f"watchdog.startup_timeout must be a positive timedelta, got {self.startup_timeout!r}")

    @property
    def timeout_s(self) -> float:
        return self.timeout.total_seconds()

    @property
    def poll_s(self) -> float:
        if self.poll is not None:
            return self.poll.total_seconds()
        return max(0.02, min(0.5, self.timeout_s / 8))

    @classmethod
    def from_env(cls, **explicit: object) -> WatchdogConfig:
        """Explicit keyword values (not None) win; the environment fills the rest."""
        values: dict[str, object] = {}
        timeout_s = _env_float(WATCHDOG_TIMEOUT_S)
        if timeout_s is not None:
            if not 0 < timeout_s <= MAX_TIMEOUT_S:
                raise ConfigError(f"{WATCHDOG_TIMEOUT_S} must be within (0, {MAX_TIMEOUT_S:g}] seconds, got {timeout_s:g}")
            values["timeout"] = timedelta(seconds=timeout_s)
        if os.environ.get(WATCHDOG_ACTION):
            values["action"] = os.environ[WATCHDOG_ACTION].strip().lower()
        if os.environ.get(WATCHDOG_DUMP_DIR):
            values["dump_dir"] = os.environ[WATCHDOG_DUMP_DIR]
        history = _env_int(WATCHDOG_HISTORY)
        if history is not None:
            values["history"] = history
        wrap = os.environ.get(WATCHDOG_WRAP, "").strip()
        if wrap:
            if wrap not in ("0", "1"):
                raise ConfigError(f"environment variable {WATCHDOG_WRAP} must be 0 or 1, got {wrap!r}")
            values["wrap"] = wrap == "1"
        compile_s = _env_float(WATCHDOG_COMPILE_TIMEOUT_S)
        if compile_s is not None:
            if not 0 < compile_s <= MAX_TIMEOUT_S:
                raise ConfigError(f"{WATCHDOG_COMPILE_TIMEOUT_S} must be > 0 seconds, got {compile_s:g}")
            values["compile_timeout"] = timedelta(seconds=compile_s)
        startup_s = _env_float(WATCHDOG_STARTUP_TIMEOUT_S)
        if startup_s is not None:
            if not 0 < startup_s <= MAX_TIMEOUT_S:
                raise ConfigError(f"{WATCHDOG_STARTUP_TIMEOUT_S} must be > 0 seconds, got {startup_s:g}")
            values["startup_timeout"] = timedelta(seconds=startup_s)
        values.update({k: v for k, v in explicit.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]
