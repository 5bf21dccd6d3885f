"""Every key distdiag uses in the job's c10d store, in one place: who writes it, who reads it.

A key posted per rank through `Exchange.post(KEY, ...)` lives as `KEY/<rank>` with a counter
`KEY/n` (distdiag/runtime/exchange.py); a job-wide key is set once with `Exchange.publish`.
The check's incident uses the bare names (one incident per run); the watchdog's carry the
event's epoch (`snap/3`), one incident per event. Values are JSON and never larger than
MAX_STORE_VALUE (distdiag/runtime/incident.py enforces it where the incident writes).

These strings are a protocol between ranks (and between versions of distdiag on one job):
change one only together with every reader.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from distdiag.errors import DistDiagError

__all__ = ["Keys", "IncidentKeys", "MAX_STORE_VALUE", "StoreValueTooLarge", "checked_value"]

MAX_STORE_VALUE = 64 * 1024
"""The largest value distdiag writes to the store, in bytes. TCPStore refuses values over
8 MiB and a refused write breaks the client's connection; torchrun's store also carries the
rendezvous and NCCL's setup, so no single value of ours may be large (issue 21)."""


class StoreValueTooLarge(DistDiagError, ValueError):
    """A value over MAX_STORE_VALUE was about to be written to the job's store."""


def checked_value(key: str, value: object) -> str:
    """`value` as the JSON text the store gets; refused when over MAX_STORE_VALUE (TCPStore takes
    up to 8 MiB, but a refused write breaks the client's connection and the store is shared)."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    size = len(text.encode())
    if size > MAX_STORE_VALUE:
        raise StoreValueTooLarge(f"store value '{key}' is {size} bytes, over distdiag's limit of {MAX_STORE_VALUE}")
    return text


class Keys:
    """The keys outside one incident (rank table, liveness, the check's steps, the watchdog's board)."""

    INFO = "info"
    """Per rank: its RankInfo row. Written by each rank at start (distdiag/check/run.py,
    distdiag/watchdog/watcher.py); read by the writer for the rank table and by phase boards."""
    ERROR = "error"
    """Per rank (watchdog): the exception the training code raised. Written by the raising
    rank before it declares; read by the writer (the exception leads the report)."""
    FINAL = "final"
    """Per rank (watchdog): the snapshot of a rank that left its watched region. Written at
    HangWatchdog's end; read by the writer (a rank that ran out of data is found by it)."""
    ABORT_REASON = "abort_reason"
    """Per rank (check): why this rank started ending the run (IncidentEvent). Written by the
    sentinel that noticed; its count is the job-wide 'abort' flag every sentinel polls."""
    LEFT = "left"
    """Per rank (check): the rank is leaving after the verdict (distdiag/check/finish.py)."""
    LEFTOVER = "leftover"
    """Per rank (check): what the user's code left running on this rank at the end (threads,
    child processes, a changed directory; distdiag/check/leftovers.py), posted before LEFT;
    read by the verdict's writer, which adds it to the report's notes."""
    ACK = "ack"
    """Per rank (check): the rank read the normal end's verdict (distdiag/check/run.py)."""
    VALID = "valid"
    """Per rank (check): the target validated on this rank, or its error (distdiag/check/run.py)."""
    BAD_INPUT = "bad_input"
    """Per rank (check): a user mistake every rank saw; they leave with 2 together."""
    SETUP_ERROR = "setup_error"
    """Per rank (check): the exception setup raised; read by the incident's writer."""
    PHASE = "phase"
    """Per rank (watchdog): its declared phase now ({name, until} or {}); `phase(rank)`."""
    PHASE_LAST = "phase_last"
    """Job-wide (watchdog): the rank that entered a phase last (peers read it first)."""
    MARKS = "marks"
    """Per rank (watchdog): prefix of `marks(rank)`."""
    ENGINE = "eng"
    """Per rank (watchdog): prefix of `engine(rank)`."""
    PHASE_COUNT = "phase_n"
    """Job-wide counter (watchdog): how many ranks are inside a declared phase now (one round
    trip tells a waiting rank there is nothing to read). distdiag/watchdog/phases.py."""

    @staticmethod
    def heartbeat(rank: int) -> str:
        """Counter bumped by each rank's sentinel every HEARTBEAT_EVERY_S (distdiag/runtime/sentinel.py)."""
        return f"hb/{rank}"

    @staticmethod
    def result(index: int) -> str:
        """Per rank (check): probe #index's result. Written by each rank; read by the consolidator."""
        return f"res/{index}"

    @staticmethod
    def shared(index: int, digest: str) -> str:
        """Probe #index's payload field that ranks post alike, stored once under its hash by the
        first rank that posts it; read by the consolidator (distdiag/check/shared_values.py)."""
        return f"{Keys.result(index)}/shared/{digest}"

    @staticmethod
    def errors(index: int) -> str:
        """Counter (check): ranks whose probe #index raised (distdiag/check/run.py)."""
        return f"err/{index}"

    @staticmethod
    def comm_errors(index: int) -> str:
        """Counter (check): ranks whose probe #index lost a connection (distdiag/check/run.py)."""
        return f"commerr/{index}"

    @staticmethod
    def caught(index: int) -> str:
        """Per rank (check): exceptions probe #index caught and went on from; read by the writer."""
        return f"caught/{index}"

    @staticmethod
    def phase(rank: int) -> str:
        """The rank's declared phase now ({name, until} or {}). distdiag/watchdog/phases.py."""
        return f"{Keys.PHASE}/{rank}"

    @staticmethod
    def marks(rank: int) -> str:
        """The digests a group's lowest rank posted at its last step marks. distdiag/watchdog/marks.py."""
        return f"{Keys.MARKS}/{rank}"

    @staticmethod
    def engine(rank: int) -> str:
        """The rank's completed counts per group from torch's recorder. distdiag/watchdog/stall.py."""
        return f"{Keys.ENGINE}/{rank}"

    @staticmethod
    def event(epoch: int) -> str:
        """Job-wide (watchdog): event #epoch (IncidentEvent), set once by compare_set by the rank
        that declares it; every watcher polls for the next epoch's key."""
        return f"event/{epoch}"


@dataclass(frozen=True)
class IncidentKeys:
    """The keys of one incident: the check's (epoch None) or the watchdog's event #epoch."""

    epoch: int | None = None

    def _k(self, name: str) -> str:
        return name if self.epoch is None else f"{name}/{self.epoch}"

    @property
    def snap(self) -> str:
        """Per rank: its RankSnapshot. Written by every rank once the incident is declared; read by the writer."""
        return self._k("snap")

    @property
    def node(self) -> str:
        """Per node leader (local rank 0): its node's snapshots in one value (distdiag/runtime/nodes.py).
        Written by each node leader that is not the writer; read by the writer (N/8 values, not N)."""
        return self._k("node")

    @property
    def writer(self) -> str:
        """Claimed (compare_set) by the rank that writes the report; read by nobody else."""
        return self._k("writer")

    @property
    def verdict(self) -> str:
        """Job-wide: the Verdict, small, published first by the writer; every other rank waits for it."""
        return self._k("verdict")

    @property
    def progress(self) -> str:
        """Counter the writer bumps at each stage; waiters give up only once it stops moving."""
        return self._k("progress")

    @property
    def stage(self) -> str:
        """Job-wide: the writer's current stage in a line ('gathered 3 of 4 snapshots'), for the
        waiter's message when the writer stalls."""
        return self._k("stage")

    @property
    def report(self) -> str:
        """Job-wide: {host, node, chunks}: the report's JSON is under report_chunk(0..chunks-1).
        Written after the verdict; read by local rank 0 of every other host (its copy)."""
        return self._k("report")

    def report_chunk(self, i: int) -> str:
        """Chunk i of the report's JSON (each at most MAX_STORE_VALUE bytes)."""
        return f"{self.report}/part/{i}"

    def again(self, rank: int) -> str:
        """Set by the writer: `rank`'s snapshot contradicted itself, post it again (watchdog)."""
        return f"again/{self.epoch}/{rank}" if self.epoch is not None else f"again/{rank}"
