"""Fault injection: one small vocabulary to prove that each diagnosis names the bug.

Used by distdiag's own tests, docs examples and benchmarks; never active unless the
environment variable DISTDIAG_INJECT names a fault. Syntax, faults separated by `;`:

    ACTION:PROBE:RANK[:after=N][:seconds=S][:code=C]

ACTION is one of
    raise    raise RuntimeError in the probe
    hang     sleep forever outside any collective
    sleep    sleep `seconds` (default 5) outside any collective
    exit     exit the process at once with `code` (default 1)
    kill     SIGKILL this process
    stop     SIGSTOP this process (a stopped process ignores SIGTERM)
    skip     do not issue one collective (the others wait for it)
    corrupt  add 1 to the result of one collective
    extra    issue one extra all_reduce of the same shape before one collective
PROBE is a probe name (or `setup`, just before the process group is initialised, or
`final`, the verdict exchange); RANK a global rank.
`after=N` fires the fault when the rank is about to issue its N-th collective of the
probe (0, the default, fires it when the probe starts; skip/corrupt/extra default to 1).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

from distdiag.errors import ConfigError

__all__ = ["INJECT_ENV", "Fault", "FaultPlan", "ACTIONS"]

INJECT_ENV = "DISTDIAG_INJECT"
ACTIONS = ("raise", "hang", "sleep", "exit", "kill", "stop", "skip", "corrupt", "extra")
_COLLECTIVE_ACTIONS = ("skip", "corrupt", "extra")


@dataclass
class Fault:
    action: str
    point: str
    rank: int
    after: int = 0
    seconds: float = 5.0
    code: int = 1
    fired: bool = field(default=False, compare=False)

    def fire(self) -> None:
        """Carry out a process-level fault (not skip/corrupt/extra, which the tracker does)."""
        self.fired = True
        if self.action == "raise":
            raise RuntimeError(
                f"injected fault: raise in {self.point} on rank {self.rank} ({INJECT_ENV})"
            )
        if self.action == "hang":
            while True:  # outside any collective, on purpose
                time.sleep(3600)
        if self.action == "sleep":
            time.sleep(self.seconds)
        elif self.action == "exit":
            os._exit(self.code)
        elif self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)


class FaultPlan:
    """The faults of this process's rank, parsed once from DISTDIAG_INJECT."""

    def __init__(self, faults: list[Fault] | None = None) -> None:
        self.faults = faults or []

    @classmethod
    def parse(
        cls, spec: str, rank: int | None = None, *, world_size: int | None = None, points: list[str] | None = None
    ) -> FaultPlan:
        """The faults of `rank` (every rank's: None). With `world_size` and `points` (the probe
        names, `setup`, `final`), a fault for a rank or a point that does not exist is bad
        input: it would never fire, and the run would pass as if it had been tested."""
        from distdiag.errors import did_you_mean, shown

        if len(spec) > 10_000:
            raise ConfigError(f"{INJECT_ENV} is {len(spec)} characters long; name a few faults")
        faults = []
        for part in (p.strip() for p in spec.split(";")):
            if not part:
                continue
            bits = part.split(":")
            if len(bits) < 3 or bits[0] not in ACTIONS:
                raise ConfigError(
                    f"{INJECT_ENV}: cannot read {shown(part)}; expected ACTION:PROBE:RANK[:after=N] "
                    f"with ACTION one of {', '.join(ACTIONS)}"
                )
            try:
                fault = Fault(action=bits[0], point=bits[1], rank=int(bits[2]))
                if fault.action in _COLLECTIVE_ACTIONS:
                    fault.after = 1
                for extra in bits[3:]:
                    key, _, value = extra.partition("=")
                    if key == "after":
                        fault.after = int(value)
                    elif key == "seconds":
                        fault.seconds = float(value)
                    elif key == "code":
                        fault.code = int(value)
                    else:
                        raise ValueError(f"unknown option {key!r}")
            except ValueError as exc:
                raise ConfigError(f"{INJECT_ENV}: cannot read {shown(part)}: {exc}") from None
            if world_size is not None and not 0 <= fault.rank < world_size:
                raise ConfigError(f"{INJECT_ENV}: {shown(part)} names rank {shown(fault.rank, 30)}; "
                                  f"this job's ranks are 0 to {world_size - 1}")
            if points is not None and fault.point not in points:
                raise ConfigError(f"{INJECT_ENV}: {shown(part)} names {shown(fault.point, 40)}{did_you_mean(fault.point, points)}, "
                                  f"not a probe; points: {', '.join(points)}")
            if rank is None or fault.rank == rank:
                faults.append(fault)
        return cls(faults)

    @classmethod
    def from_env(cls, rank: int, *, world_size: int | None = None, points: list[str] | None = None) -> FaultPlan:
        return cls.parse(os.environ.get(INJECT_ENV, ""), rank, world_size=world_size, points=points)

    def __bool__(self) -> bool:
        return bool(self.faults)

    def at(self, point: str, collectives_done: int) -> None:
        """Fire the process-level faults due at this point (probe start or before a collective)."""
        for fault in self.faults:
            if (
                not fault.fired
                and fault.point == point
                and fault.action not in _COLLECTIVE_ACTIONS
                and fault.after == collectives_done
            ):
                fault.fire()

    def collective_fault(self, point: str, collective_index: int) -> str | None:
        """'skip', 'corrupt' or 'extra' when one is due for this collective (1-based index)."""
        for fault in self.faults:
            if (
                not fault.fired
                and fault.point == point
                and fault.action in _COLLECTIVE_ACTIONS
                and fault.after == collective_index
            ):
                fault.fired = True
                return fault.action
        return None
