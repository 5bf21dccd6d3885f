"""The incident, typed: what one rank says when a run stops, why a rank is silent, the verdict.

The check and the watchdog end a broken run the same way: declare an event, every rank posts
a snapshot, one rank writes the report and publishes a verdict (distdiag/runtime/incident.py
runs that protocol for both).
Their store values were untyped dicts read by key in many files and decisions were taken by
matching words of our own messages; they are these types now. Each `to_dict` writes the JSON
shape reports have always shown; each `from_dict` keeps fields it does not know (`extra`), so
a newer rank's snapshot read by an older writer, or the reverse, loses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from distdiag.report.model import EXIT_HANG, Words

__all__ = [
    "Cause", "CAUSE_DESYNC", "CAUSE_DEADLOCK", "CAUSE_UNEVEN", "CAUSE_RAISED", "CAUSE_CAUGHT", "CAUSE_STALLED",
    "EventKind", "IncidentEvent", "SilentReason", "Silence", "RankSnapshot", "PhaseState", "GroupPosition",
    "EngineView", "Verdict", "event_of",
]


class EventKind(str, Enum):
    """Why a run is being ended (`IncidentEvent.kind`)."""

    TIMEOUT = "timeout"
    """A rank made no progress for its deadline (a probe's, a phase's, the watchdog's)."""
    DEADLINE = "deadline"
    """The whole check ran past --deadline-s."""
    TERMINATED = "terminated"
    """SIGTERM/SIGINT from the launcher (another worker failed, or the job was cancelled)."""
    PEER = "peer"
    """Another rank ended the run (this rank only follows)."""
    SETUP = "setup"
    """The check's setup failed or ranks did not check in."""
    LOST = "lost"
    """A connection between ranks broke (a peer's process left)."""
    STRANDED = "stranded"
    """A probe raised on one rank and the others did not finish."""
    DESYNC = "desync"
    """Ranks issued different collectives (the watchdog's step-mark digests differ)."""
    RAISED = "raised"
    """The training code raised on this rank."""
    PEER_ERROR = "peer_error"
    """The training code raised a communication error caused by a peer."""
    OTHER = "other"
    """A kind this version does not know (from a newer rank); its text is kept."""

    @classmethod
    def _missing_(cls, value: object) -> EventKind:
        return cls.OTHER


@dataclass
class IncidentEvent:
    """The job-wide event (the watchdog's `event/N`) or one rank's reason (the check's `abort_reason`)."""

    kind: EventKind
    detail: Any = ""
    """A line (str), or the desync's mark comparison (dict: group, step, rank, ref, mine, theirs)."""
    rank: int = -1
    """The rank that declared it."""
    kind_text: str = ""
    """The kind as written, when it is not one of EventKind (kept for the round trip)."""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind_text or self.kind.value, "detail": self.detail, "rank": self.rank}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> IncidentEvent:
        raw = d.get("kind", "")
        raw = raw.value if isinstance(raw, EventKind) else str(raw)
        kind = EventKind(raw)
        return cls(kind, d.get("detail", ""), _int(d.get("rank"), -1), raw if kind.value != raw else "")

    def detail_line(self) -> str:
        return self.detail if isinstance(self.detail, str) else str(self.detail)


class SilentReason(str, Enum):
    """Why a rank posted no snapshot, as far as the writer's host can tell."""

    GONE = "gone"
    """Its process is gone (killed, exited) or a zombie."""
    STOPPED = "stopped"
    """Its process is stopped (SIGSTOP, a debugger): it ignores SIGTERM, end it by pid."""
    ALIVE_SILENT = "alive_silent"
    """Its process lives but its watcher thread did not answer (holding the GIL?)."""
    OTHER_STATE = "other_state"
    """Its process is in a state we do not classify."""
    NEVER_CHECKED_IN = "never_checked_in"
    """No rank table entry: it was still starting, or died before it connected."""
    NO_ANSWER = "no_answer"
    """On another host: dead, stopped or unreachable, this host cannot tell."""
    NO_DUMP = "no_dump"
    """Post-mortem: no flight-recorder dump of this rank was given."""

    @property
    def definite(self) -> bool:
        """The rank will never answer (gone or stopped), whatever we wait."""
        return self in (SilentReason.GONE, SilentReason.STOPPED)

    @property
    def cause(self) -> str:
        """The `cause` of the finding that names ranks silent for this reason."""
        return _SILENT_CAUSE[self]


_SILENT_CAUSE = {
    SilentReason.GONE: "process_gone", SilentReason.STOPPED: "process_stopped",
    SilentReason.ALIVE_SILENT: "rank_unresponsive", SilentReason.OTHER_STATE: "process_state",
    SilentReason.NEVER_CHECKED_IN: "never_checked_in", SilentReason.NO_ANSWER: "host_unreachable",
    SilentReason.NO_DUMP: "no_dump",
}

class Cause(Words):
    """The causes the hang analysis names (report/model.py Finding.cause), named once; a member
    is its word wherever it is compared or written (the report's JSON is unchanged). The silent
    ranks' causes are SilentReason.cause."""

    DESYNC = "desync"
    DEADLOCK = "deadlock"
    UNEVEN = "uneven_data"
    RAISED = "raised"
    CAUGHT = "caught_exception"
    STALLED = "stalled"
    """No rank is inside a collective and the step did not finish within the deadline."""
    ABORTED = "aborted_in_collective"
    BROKEN_CONNECTION = "broken_connection"
    LEFT_EARLY = "left_early"
    SKIPPED = "skipped_collective"
    BEHIND = "rank_behind"
    COLLECTIVE_STALL = "collective_stall"
    STALE_COMPLETION = "stale_completion"
    NOT_STARTED = "not_started"
    IN_FLIGHT = "in_flight"
    STRANDED = "stranded"
    PHASE_OVER_BUDGET = "phase_over_budget"
    RECORDER_BLIND = "recorder_blind"


# The names the rules have always imported.
CAUSE_DESYNC = Cause.DESYNC
CAUSE_DEADLOCK = Cause.DEADLOCK
CAUSE_UNEVEN = Cause.UNEVEN
CAUSE_RAISED = Cause.RAISED
CAUSE_CAUGHT = Cause.CAUGHT
CAUSE_STALLED = Cause.STALLED


class Silence(str):
    """Why one rank is silent: the line the report shows, with its `reason` as a SilentReason.

    A str, so reports and findings that quote it stay as they were; decisions read `reason`.
    """

    reason: SilentReason
    death: Any
    """How the process died (distdiag.runtime.deathnote.Death), when a same-host peer read it."""

    def __new__(cls, reason: SilentReason, text: str, death: Any = None) -> Silence:
        obj = super().__new__(cls, text)
        obj.reason = reason
        obj.death = death
        return obj

    def __getnewargs__(self) -> tuple[Any, ...]:  # copy and pickle keep the reason
        return (self.reason, str(self), self.death)

    def noted(self, note: str) -> Silence:
        """The same reason with more said about it."""
        return Silence(self.reason, f"{self}{note}", self.death)

    @staticmethod
    def death_of(why: str) -> Any:
        """The Death attached to a Silence, or None."""
        return getattr(why, "death", None)

    @staticmethod
    def reason_of(why: str) -> SilentReason | None:
        """The reason of a Silence; None for a plain line (from an older writer)."""
        return why.reason if isinstance(why, Silence) else None


@dataclass
class PhaseState:
    """A phase the training code declared (checkpoint, eval, ...), as the snapshot saw it."""

    name: str
    budget_s: float
    for_s: float

    @property
    def over_budget(self) -> bool:
        return self.for_s > self.budget_s

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "budget_s": self.budget_s, "for_s": self.for_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PhaseState:
        return cls(str(d.get("name", "?")), float(d.get("budget_s", 0.0)), float(d.get("for_s", 0.0)))


@dataclass
class GroupPosition:
    """How far torch's flight recorder says this rank is on one process group."""

    group: str
    enqueued: int = -1
    completed: int = -1
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def inside(self) -> bool:
        """Inside collective #enqueued, not completed yet (by the counts)."""
        return self.enqueued > self.completed

    @property
    def pending(self) -> dict[str, Any] | None:
        """The recorder's entry of the collective this rank waits in on the group (op, seq,
        shape, dtype, for_s, call_site), when the reader found one."""
        entry = self.extra.get("pending")
        return entry if isinstance(entry, dict) else None

    def to_dict(self) -> dict[str, Any]:
        return {**self.extra, "group": self.group, "enqueued": self.enqueued, "completed": self.completed}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GroupPosition:
        extra = d  # not copied (16k ranks x their groups are read at once): to_dict writes the fields over it
        return cls(str(d.get("group")), int(d.get("enqueued", -1)), int(d.get("completed", -1)), extra)


@dataclass
class EngineView:
    """torch's flight recorder as one rank read it (distdiag/hang/recorder.py EngineReader.read)."""

    state: str = "unavailable"
    """ok | stale (left out of the analysis) | anything else: the recorder could not be read."""
    groups: list[GroupPosition] = field(default_factory=list)
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    """Entries, call sites and whatever else the reader adds, kept as read."""

    @property
    def ok(self) -> bool:
        return self.state == "ok"

    def to_dict(self) -> dict[str, Any]:
        out = {**self.extra, "state": self.state, "groups": [g.to_dict() for g in self.groups]}
        out.pop("reason", None)
        if self.reason:
            out["reason"] = self.reason
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineView:
        extra = d  # not copied: to_dict writes the typed fields over it
        groups = [GroupPosition.from_dict(g) for g in d.get("groups") or []]
        return cls(str(d.get("state", "unavailable")), groups, str(d.get("reason", "") or ""), extra)

    @classmethod
    def stale(cls, why: str, entries: list[Any] | None = None) -> EngineView:
        """Counts left out of the analysis; the entries (what this rank recorded, with call
        sites) kept when given: a count that contradicts the peers for good is a rank inside a
        collective they paired with another one, and its entries are how the desync shows."""
        return cls("stale", [], why, {"entries": entries} if entries else {})


_FIELDS = ("rank", "host", "pid", "phase", "probe_index", "step", "steps", "importing", "reread", "phases", "engine",
           "event", "reason", "stack", "in_collective", "in_loop")
_OPTIONAL = ("host", "pid", "phase", "probe_index", "step", "steps", "importing", "in_collective", "in_loop")


@dataclass
class RankSnapshot:
    """Where one rank was when the run stopped: what it posts under `snap`/`final` in the store.

    Typed fields are what the protocol and the analysis decide on; everything else the rank's
    tracker or progress recorder wrote (history, recent records, step timings, ...) rides in
    `extra` and comes back unchanged in `to_dict`.
    """

    rank: int
    host: str = "?"
    pid: int = -1
    phase: str = ""
    """checkin | setup | probe | barrier | final (the check); training | barrier (the watchdog:
    barrier = the rank left its watched region, a final snapshot)."""
    probe_index: int = -1
    step: Any = None
    steps: int | None = None
    importing: bool = False
    """The training thread is inside an import, within the startup budget (a job still starting)."""
    reread: bool = False
    """Posted again because the writer found the first one contradicting itself."""
    in_collective: dict[str, Any] | None = None
    """The collective our wrappers saw this rank enter and not leave (op, group, seq, shape,
    dtype, call_site, for_s), if any."""
    in_loop: bool | None = None
    """Whether the rank is still inside its training loop's frame (watchdog; None: unknown)."""
    phases: list[PhaseState] = field(default_factory=list)
    engine: EngineView | None = None
    event: IncidentEvent | None = None
    """The event this snapshot answers (the watchdog's) or this rank's own reason (the check's)."""
    stack: list[Any] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    event_key: str = "event"
    """Under which key the event is written: `event` (watchdog) or `reason` (check)."""
    present: set[str] = field(default_factory=set, repr=False, compare=False)
    """The optional fields the posted dict had (written back even at their default)."""

    @property
    def waiting(self) -> bool:
        """Inside a collective, by our wrappers or by torch's recorder."""
        return bool(self.in_collective) or (
            self.engine is not None and self.engine.ok and any(g.pending for g in self.engine.groups))

    @property
    def finished(self) -> bool:
        """A final snapshot: the rank left its watched region (watchdog) or is in the check's final step."""
        return self.phase == "barrier"

    def over_budget(self) -> list[PhaseState]:
        return [p for p in self.phases if p.over_budget]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.extra)
        out["rank"] = self.rank
        # Defaults are left out, so a snapshot reads back as it was posted.
        for name, value, default in (("host", self.host, "?"), ("pid", self.pid, -1), ("phase", self.phase, ""),
                                     ("probe_index", self.probe_index, -1), ("step", self.step, None),
                                     ("steps", self.steps, None), ("in_collective", self.in_collective, None),
                                     ("in_loop", self.in_loop, None)):
            if value != default or name in self.present:
                out[name] = value
        out["stack"] = self.stack
        if self.phases:
            out["phases"] = [p.to_dict() for p in self.phases]
        if self.importing or "importing" in self.present:
            out["importing"] = self.importing
        if self.reread:
            out["reread"] = 1
        if self.engine is not None:
            out["engine"] = self.engine.to_dict()
        if self.event is not None:
            out[self.event_key] = self.event.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RankSnapshot:
        key = "reason" if "reason" in d and "event" not in d else "event"
        ev = d.get(key)
        engine = d.get("engine")
        return cls(
            rank=_int(d.get("rank"), -1), host=str(d.get("host", "?")), pid=_int(d.get("pid"), -1),
            phase=str(d.get("phase", "") or ""), probe_index=_int(d.get("probe_index"), -1),
            step=d.get("step"), steps=d.get("steps"), importing=bool(d.get("importing")), reread=bool(d.get("reread")),
            in_collective=d.get("in_collective") or None, in_loop=d.get("in_loop"),
            phases=[PhaseState.from_dict(p) for p in d.get("phases") or []],
            engine=EngineView.from_dict(engine) if isinstance(engine, dict) else None,
            event=IncidentEvent.from_dict(ev) if isinstance(ev, dict) else None,
            stack=list(d.get("stack") or []),
            extra=_without(d, _FIELDS),
            event_key=key,
            present={k for k in _OPTIONAL if k in d},
        )


def _without(d: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """A copy of `d` without `names` (a C-level copy: 16k ranks' snapshots are read at once)."""
    out = dict(d)
    for name in names:
        out.pop(name, None)
    return out


def _int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def event_of(e: IncidentEvent | dict[str, Any]) -> IncidentEvent:
    return e if isinstance(e, IncidentEvent) else IncidentEvent.from_dict(e)


def _ranks(value: Any) -> list[int]:
    """A verdict's blamed ranks as published (a list of ints; anything else: none)."""
    if not isinstance(value, list):
        return []
    return [r for r in value if isinstance(r, int) and not isinstance(r, bool)][:64]


@dataclass
class Verdict:
    """What every waiting rank needs to leave: small (a few hundred bytes), published first.

    The report itself is on the writer's disk (`report`) and, for the other hosts, in the
    store in chunks (distdiag/runtime/incident.py); the verdict never carries it.
    """

    exit_code: int
    writer: int
    host: str = ""
    node: int = -1
    outcome: str = ""
    summary: str = ""
    """One line, capped (SUMMARY_MAX characters)."""
    report: str = ""
    """Where the writer wrote the report (an absolute path), or why it could not."""
    excused: str | None = None
    """The watchdog's declared timeout was no hang after all: why (nobody acts)."""
    chunks: int = 0
    """How many chunks of the report's JSON the store holds for other hosts (0: none)."""
    blamed: list[int] = field(default_factory=list)
    """The ranks the report blames (at most 64): their torchrun error file dates the failure
    first, so torchrun's root cause names them (distdiag/runtime/lastword.py)."""

    SUMMARY_MAX = 300

    def to_dict(self) -> dict[str, Any]:
        return {"exit_code": self.exit_code, "writer": self.writer, "host": self.host, "node": self.node,
                "outcome": self.outcome, "summary": self.summary[: self.SUMMARY_MAX], "report": self.report,
                "excused": self.excused, "chunks": self.chunks, "blamed": list(self.blamed)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        return cls(int(d.get("exit_code", EXIT_HANG)), int(d.get("writer", -1)), str(d.get("host", "") or ""),
                   int(d.get("node", -1) if d.get("node") is not None else -1), str(d.get("outcome", "") or ""),
                   str(d.get("summary", "") or ""), str(d.get("report", "") or ""), d.get("excused"),
                   int(d.get("chunks", 0) or 0), _ranks(d.get("blamed")))
