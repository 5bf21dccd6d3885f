"""The report model: Finding, ProbeResult, Report; exit codes; JSON that round-trips.

The JSON layout is a contract (docs/report-schema.md). `Report.to_dict()` and
`Report.from_dict()` are inverse; `write_report` is atomic (temp file + rename), so a reader
never sees half a report even when the writer is killed mid-write.
"""

from __future__ import annotations

import copy
import datetime as _dt
import functools
import json
import os
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from distdiag.errors import ReportError
from distdiag.report.hostlist import slurm_hostlist
from distdiag.report.safefile import MAX_REPORT_BYTES, RefusedFile, non_regular_kind, read_bytes_limited, write_atomic
from distdiag.report.schema import MAX_DEPTH, json_depth, report_type_problem

__all__ = [
    "now_iso",
    "SCHEMA",
    "Words",
    "Severity",
    "Status",
    "SEVERITIES",
    "STATUSES",
    "EXIT_PASS",
    "EXIT_FAIL",
    "EXIT_BAD_INPUT",
    "EXIT_HANG",
    "EXIT_DRAIN",
    "Finding",
    "ProbeResult",
    "RankInfo",
    "Report",
    "exit_code_for",
    "write_report",
    "write_json_atomic",
    "read_report",
    "non_regular_kind",
    "group_by_node",
]

SCHEMA = "distdiag.report/1"

class Words(str, Enum):
    """A closed set of words the report writes. A member is its value wherever it is compared,
    hashed, printed or written as JSON: `Severity.ERROR == "error"`, and f"{Severity.ERROR}" is
    "error" (str's own str and format: an Enum's print its name from Python 3.11)."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)


class Severity(Words):
    """A finding's severity, from least to most severe. `error` fails a probe; `critical` means
    the run itself broke (a rank hung, died or never reported)."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"


class Status(Words):
    """A probe's status in the report."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"
    ERROR = "error"


SEVERITIES: tuple[str, ...] = tuple(s.value for s in Severity)
"""The severities' values, least severe first ("info", "warning", "error", "critical")."""

STATUSES: tuple[str, ...] = tuple(s.value for s in Status)

EXIT_PASS = 0
"""Every probe passed (warnings allowed)."""
EXIT_FAIL = 1
"""At least one probe failed or raised."""
EXIT_BAD_INPUT = 2
"""Bad input: nothing ran."""
EXIT_HANG = 3
"""A rank hung, died or never reported."""
EXIT_DRAIN = 4
"""A finding says: take this node out (cluster gate)."""
EXIT_CANCELLED = 130
"""The run was cancelled: every rank (or the launcher) was stopped by a signal (SIGINT, SIGTERM)
and nobody is blamed; the shell's code for Ctrl-C, whatever the signal. Not a verdict on the
job: rerun it."""


@functools.cache
def distdiag_version() -> str:
    """This distdiag's version (the report's `distdiag_version`)."""
    # the package this module belongs to, imported before it (report/ imports no other distdiag
    # package: distdiag/__init__.py itself is a leaf that defines the version)
    return str(getattr(sys.modules.get("distdiag"), "__version__", ""))


@functools.cache
def torch_version() -> str:
    """The torch this process runs (the report's `torch_version`): the imported module's own
    version, else the installed distribution's, read without importing torch (`distdiag
    hang-report` and `report show` stay light); "" where there is none."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(getattr(torch, "__version__", None), str):
        return str(torch.__version__)
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("torch")
    except (PackageNotFoundError, ValueError):
        return ""


def _severity_rank(severity: str) -> int:
    return SEVERITIES.index(severity)


@dataclass
class Finding:
    """One thing a probe found, with what a user needs to act on it."""

    severity: str
    """info | warning | error | critical (a Severity, or its value)."""
    issue: str
    """What is wrong, in one sentence that names ranks, sizes and values."""
    evidence: str = ""
    """What was measured or seen that shows it."""
    ranks: list[int] = field(default_factory=list)
    """The global ranks concerned (empty: the whole job)."""
    fix: str = ""
    """What to do about it."""
    confidence: float = 1.0
    """How sure the probe is, from 0 to 1."""
    drain: dict[str, Any] | None = None
    """Set when the finding means "take this node out": {"host": ..., "device": ...}."""
    cause: str = ""
    """The mechanism the evidence supports, as a stable snake_case name (e.g.
    "grad_clip_per_rank", "uneven_data", "deadlock"), for tools and for decisions taken on
    findings; empty when the finding names no mechanism. The words stay in issue and fix."""

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"finding severity must be one of {SEVERITIES}, got {self.severity!r}")
        if not 0.0 <= float(self.confidence) <= 1.0:
            raise ValueError(f"finding confidence must be within [0, 1], got {self.confidence}")
        self.ranks = sorted({int(r) for r in self.ranks})
        self.confidence = float(self.confidence)

    def to_dict(self) -> dict[str, Any]:
        # Written out rather than dataclasses.asdict, which deep-copies field by field (a
        # second for the findings and rank rows of a 16k-rank report); same keys, same order.
        data: dict[str, Any] = {"severity": self.severity, "issue": self.issue, "evidence": self.evidence,
                                "ranks": list(self.ranks), "fix": self.fix, "confidence": self.confidence}
        if self.drain is not None:
            data["drain"] = copy.deepcopy(self.drain)
        if self.cause:
            data["cause"] = self.cause
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        return cls(
            severity=data["severity"],
            issue=data["issue"],
            evidence=data.get("evidence", ""),
            ranks=list(data.get("ranks", [])),
            fix=data.get("fix", ""),
            confidence=data.get("confidence", 1.0),
            drain=data.get("drain"),
            cause=data.get("cause") or "",
        )


@dataclass
class ProbeResult:
    """What one probe concluded over all ranks."""

    name: str
    status: str = "pass"
    findings: list[Finding] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)
    """Structured tables a probe adds beside its findings ({"table_name": [row, ...]})."""
    reason: str = ""
    """Why the probe was skipped or errored, in one line."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"probe status must be one of {STATUSES}, got {self.status!r}")

    @classmethod
    def from_findings(cls, name: str, findings: list[Finding], **kwargs: Any) -> ProbeResult:
        """Derive the status from the worst finding: error/critical fail, warning warns."""
        worst = max((_severity_rank(f.severity) for f in findings), default=0)
        status = "fail" if worst >= _severity_rank("error") else "warn" if worst == 1 else "pass"
        return cls(name=name, status=status, findings=findings, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "findings": [f.to_dict() for f in self.findings],
            "metrics": self.metrics,
            "duration_s": round(float(self.duration_s), 4),
            "details": self.details,
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProbeResult:
        return cls(
            name=data["name"],
            status=data["status"],
            findings=[Finding.from_dict(f) for f in data.get("findings", [])],
            metrics=dict(data.get("metrics", {})),
            duration_s=float(data.get("duration_s", 0.0)),
            details=dict(data.get("details", {})),
            reason=data.get("reason", ""),
        )


@dataclass
class RankInfo:
    """One row of the rank table: where a global rank ran."""

    rank: int
    host: str
    node: int
    """torchrun's GROUP_RANK: the index of the node (agent) this rank ran on."""
    local_rank: int
    device: str
    pid: int

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "node": self.node, "local_rank": self.local_rank,
                "device": self.device, "pid": self.pid}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankInfo:
        return cls(**{k: data[k] for k in ("rank", "host", "node", "local_rank", "device", "pid")})


def group_by_node(report: Report) -> dict[str, Any]:
    """Findings grouped per node (torchrun's GROUP_RANK, with its host), for operators.

    Each node lists the findings that name one of its ranks (restricted to those ranks) or
    that drain its host; findings naming no rank and draining nothing are job-wide. Derived
    from `probes` and `ranks`, so it is written but never read back. One pass over the
    findings (linear in ranks named), so it stays cheap on thousands of ranks.
    """
    node_of: dict[int, tuple[int, str]] = {}
    nodes: dict[tuple[int, str], list[int]] = {}
    by_host: dict[str | None, list[tuple[int, str]]] = {}  # read with a drain's host, which may be None
    for info in report.ranks:
        key = (info.node, info.host)
        node_of[info.rank] = key
        if key not in nodes:
            by_host.setdefault(info.host, []).append(key)
        nodes.setdefault(key, []).append(info.rank)
    items: dict[tuple[int, str], list[dict[str, Any]]] = {key: [] for key in nodes}
    job = []
    for probe, f in report.findings():
        touched: dict[tuple[int, str], list[int]] = {}
        for r in f.ranks:
            if r in node_of:
                touched.setdefault(node_of[r], []).append(r)
        if f.drain and not f.ranks:
            for key in by_host.get(f.drain.get("host"), []):
                touched.setdefault(key, [])
        if not f.ranks and not f.drain:
            job.append({"probe": probe, "severity": f.severity, "issue": f.issue})
        for key, ranks in touched.items():
            item: dict[str, Any] = {"probe": probe, "severity": f.severity, "issue": f.issue, "ranks": ranks}
            if f.drain and f.drain.get("host") == key[1]:
                item["drain"] = f.drain
            items[key].append(item)
    out: dict[str, Any] = {"nodes": [], "job": job}
    for key in sorted(nodes):
        worst = max((_severity_rank(i["severity"]) for i in items[key]), default=-1)
        out["nodes"].append({
            "node": key[0], "host": key[1], "ranks": sorted(nodes[key]),
            "worst": SEVERITIES[worst] if worst >= 0 else "none",
            "drain": any("drain" in i for i in items[key]), "findings": items[key],
        })
    return out


def _hostlist(report: Report) -> str:
    """Every host of the rank table in Slurm's hostlist syntax (`scontrol show hostnames`
    expands it); derived from `ranks`, written, never read back."""
    return slurm_hostlist(sorted({r.host for r in report.ranks if r.host not in ("", "?")}))


def now_iso() -> str:
    """A report's `created`: UTC, to the second."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def exit_code_for(probes: list[ProbeResult], *, hung: bool = False, bad_input: bool = False) -> int:
    """The contract: 2 stands alone (nothing ran), else 3 over 4 over 1 over 0."""
    if bad_input:
        return EXIT_BAD_INPUT
    if hung:
        return EXIT_HANG
    findings = [f for p in probes for f in p.findings]
    if any(f.severity == Severity.CRITICAL for f in findings):
        return EXIT_HANG
    if any(f.drain for f in findings):
        return EXIT_DRAIN
    if any(p.status in (Status.FAIL, Status.ERROR) for p in probes):
        return EXIT_FAIL
    return EXIT_PASS


def verdict_for(exit_code: int, probes: list[ProbeResult]) -> str:
    """pass | warn | fail | error (error: bad input, nothing ran)."""
    if exit_code == EXIT_BAD_INPUT:
        return "error"
    if exit_code != EXIT_PASS:
        return "fail"
    if any(p.status == Status.WARN for p in probes):
        return "warn"
    return "pass"


@dataclass
class Report:
    """The whole check, as written to distdiag-report.json."""

    world_size: int
    probes: list[ProbeResult] = field(default_factory=list)
    ranks: list[RankInfo] = field(default_factory=list)
    exit_code: int = EXIT_PASS
    verdict: str = "pass"
    outcome: str = "completed"
    """completed | hang | lost_rank | stranded | deadline | terminated | cancelled | bad_input."""
    summary: str = ""
    """The one-line verdict rank 0 prints."""
    not_run: list[str] = field(default_factory=list)
    """Probes of the plan that never ran because the run ended early."""
    restart_count: int = 0
    notes: list[str] = field(default_factory=list)
    """What this run could not see, said under the table (e.g. bugs the launch method hides)."""
    run_id: str = ""
    launch_id: str = ""
    """The id of the `distdiag check`/`gate` run that launched this check (its ranks get it as
    DISTDIAG_LAUNCH_ID); the launcher takes only a report carrying its own id. Empty under a
    bare torchrun."""
    created: str = ""
    duration_s: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)
    written_by: int = 0
    """The global rank whose process wrote this report (not always rank 0)."""
    schema: str = SCHEMA
    distdiag_version: str = field(default_factory=distdiag_version)
    """The distdiag that wrote the report ("" in a report read back from before the field)."""
    torch_version: str = field(default_factory=torch_version)
    """The torch the writing process ran ("" when unknown)."""

    def findings(self, min_severity: str = "info") -> list[tuple[str, Finding]]:
        floor = _severity_rank(min_severity)
        return [
            (p.name, f)
            for p in self.probes
            for f in p.findings
            if _severity_rank(f.severity) >= floor
        ]

    def probe(self, name: str) -> ProbeResult | None:
        return next((p for p in self.probes if p.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "distdiag_version": self.distdiag_version,
            "torch_version": self.torch_version,
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "outcome": self.outcome,
            "summary": self.summary,
            "world_size": self.world_size,
            "restart_count": self.restart_count,
            "run_id": self.run_id,
            "launch_id": self.launch_id,
            "created": self.created,
            "duration_s": round(float(self.duration_s), 3),
            "written_by": self.written_by,
            "ranks": [r.to_dict() for r in self.ranks],
            "probes": [p.to_dict() for p in self.probes],
            "not_run": list(self.not_run),
            **({"notes": list(self.notes)} if self.notes else {}),
            "by_node": group_by_node(self),
            "hostlist": _hostlist(self),
            "config": self.config,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        schema = data.get("schema", "")
        if not isinstance(schema, str) or not schema.startswith("distdiag.report/"):
            raise ReportError(f"not a distdiag report (schema {schema!r}, expected {SCHEMA!r})")
        if schema.split("/", 1)[1] != SCHEMA.split("/", 1)[1]:
            raise ReportError(f"report schema {schema!r} is not supported (this is {SCHEMA!r})")
        return cls(
            world_size=int(data["world_size"]),
            probes=[ProbeResult.from_dict(p) for p in data.get("probes", [])],
            ranks=[RankInfo.from_dict(r) for r in data.get("ranks", [])],
            exit_code=int(data.get("exit_code", 0)),
            verdict=data.get("verdict", "pass"),
            outcome=data.get("outcome", "completed"),
            summary=data.get("summary", ""),
            not_run=list(data.get("not_run", [])),
            notes=[str(n) for n in data.get("notes") or []],
            restart_count=int(data.get("restart_count", 0)),
            run_id=data.get("run_id", ""),
            launch_id=data.get("launch_id", ""),
            created=data.get("created", ""),
            duration_s=float(data.get("duration_s", 0.0)),
            config=dict(data.get("config", {})),
            written_by=int(data.get("written_by", 0)),
            schema=schema,
            distdiag_version=str(data.get("distdiag_version") or ""),
            torch_version=str(data.get("torch_version") or ""),
        )

    def to_json(self) -> str:
        # Indented for people up to INDENT_RANKS ranks; past that one line: the indenting
        # encoder is pure Python (15 s for a 4096-rank hang report's details, the C one ~1 s).
        # One line past that also skips the search for cycles (10% of a 16k-rank report's
        # serialising): to_dict builds a tree of values that came through the store as JSON.
        small = self.world_size <= INDENT_RANKS
        return json.dumps(self.to_dict(), indent=2 if small else None, sort_keys=False, default=_json_default,
                          check_circular=small)


INDENT_RANKS = 256
"""Reports of jobs larger than this are written as one JSON line (see Report.to_json)."""


def _json_default(value: Any) -> Any:
    # Tensors' scalars, numpy numbers and paths sneak into metrics; make them plain.
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)


def write_json_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write `text` to `path` so that readers see the old file or the new one, never half.

    A symbolic link at the path is refused, not followed (on a shared /tmp a planted link
    would otherwise choose the file we overwrite), and so are a FIFO, device, directory or
    socket: OSError (RefusedFile) with one line. The file is created 0644 minus the umask,
    like any file the user writes. See distdiag/report/safefile.py.
    """
    return write_atomic(path, text + "\n")


def write_report(report: Report, path: str | os.PathLike[str], text: str | None = None) -> Path:
    """Write the report atomically as JSON; `text`: its `to_json()` when the caller already has
    it (a 16k-rank report takes a second to serialise: the writers share it with other hosts too)."""
    return write_json_atomic(path, report.to_json() if text is None else text)


def read_report(path: str | os.PathLike[str]) -> Report:
    """Read a report back; a missing, truncated, foreign or mistyped file raises ReportError
    with one line (every field is type-checked first, so rendering never meets a surprise)."""
    target = Path(path)
    try:
        text = read_bytes_limited(target, MAX_REPORT_BYTES, "a report file").decode("utf-8")
    except RefusedFile as exc:
        raise ReportError(str(exc)) from None
    except FileNotFoundError:
        raise ReportError(f"no report at {target}") from None
    except UnicodeDecodeError as exc:
        raise ReportError(
            f"{target} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}): not a distdiag report"
        ) from None
    except OSError as exc:
        raise ReportError(f"cannot read report {target}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        if not isinstance(exc, json.JSONDecodeError):  # an integer of thousands of digits
            raise ReportError(f"{target} holds an integer of over {sys.get_int_max_str_digits()} digits: not a distdiag report") from None
        raise ReportError(
            f"{target} is not valid JSON (line {exc.lineno}, column {exc.colno}): "
            "truncated or not a distdiag report"
        ) from None
    except RecursionError:
        raise ReportError(f"{target} nests JSON too deeply to read: not a distdiag report") from None
    if not isinstance(data, dict):
        raise ReportError(f"{target} holds a JSON {type(data).__name__}, not a distdiag report")
    schema = data.get("schema", "")
    if not isinstance(schema, str) or not schema.startswith("distdiag.report/"):
        raise ReportError(f"{target} is not a distdiag report (schema {schema!r}, expected {SCHEMA!r})")
    if schema.split("/", 1)[1] != SCHEMA.split("/", 1)[1]:
        raise ReportError(f"{target}: report schema {schema!r} is not supported (this is {SCHEMA!r})")
    if json_depth(data) > MAX_DEPTH:
        raise ReportError(f"{target} nests JSON deeper than {MAX_DEPTH} levels: not a distdiag report")
    problem = report_type_problem(data)
    if problem:
        raise ReportError(f"{target} is not a valid distdiag report: {problem}")
    try:
        return Report.from_dict(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise ReportError(f"{target} is not a valid distdiag report: {exc}") from None
