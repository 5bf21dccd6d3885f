"""The probe plug-in: runs on every rank, concluded once on the writing rank."""

from __future__ import annotations

import abc
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict, TypeVar

from distdiag.report.model import Finding, ProbeResult, RankInfo

if TYPE_CHECKING:
    from distdiag.runtime.context import RankContext

__all__ = [
    "Probe", "ConsolidationView", "SHARDING_IMPORTS", "DCP_IMPORTS",
    "merge_local_findings", "local_finding", "LocalFinding", "group_ranks", "minority_ranks", "alike", "group_alike",
]


SHARDING_IMPORTS: tuple[str, ...] = ("torch.distributed.fsdp", "torch.distributed.tensor", "torch._dynamo")
"""What a probe that shards a model with FSDP2 imports: DTensor's op tables and sympy, and all
of torch._dynamo (DTensor's constructor and its sharding propagation's FakeTensorMode load it)."""

K = TypeVar("K", bound=Hashable)
"""A value ranks are grouped by."""
V = TypeVar("V")

DCP_IMPORTS: tuple[str, ...] = ("torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict")


@dataclass
class ConsolidationView:
    """What consolidation knows about the job: its size, the rank table, the probe's options."""

    world_size: int
    ranks: list[RankInfo]
    options: Any = None

    def host_of(self, rank: int) -> str:
        return self.ranks[rank].host if rank < len(self.ranks) else "?"


class Probe(abc.ABC):
    """A diagnostic that runs on every rank and reports findings, never just True/False.

    `run` is called on every rank's main thread under the probe deadline. It may issue
    collectives, but only through `ctx.comm` (so hangs can be attributed) and the same
    sequence on every rank. It returns a JSON-able payload; raising makes the probe `error`
    on that rank, with the exception summary as a finding. `consolidate` runs once, on the
    rank that writes the report, over every rank's payload, and issues no collectives.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    """One line: what bug this probe catches (shown by `distdiag probes`)."""
    min_world_size: ClassVar[int] = 1
    default_enabled: ClassVar[bool] = True
    """False: left out of the default suite (too slow); runs when a profile or --probes names it."""
    Config: ClassVar[type | None] = None
    """A dataclass of options, read from the `[probes.NAME]` table of the config."""
    times_ranks: ClassVar[bool] = False
    """True: the probe compares ranks by how long they took (bandwidth's straggler scores): the
    check's rank 0 finishes consolidating the probes before it (distdiag/check/ahead.py) on its
    other thread first, so that this thread holding the GIL cannot make rank 0 look slow."""
    shared_fields: ClassVar[tuple[str, ...]] = ()
    """Payload fields usually the same on every rank (a model's digests): the check stores each
    distinct value once instead of once per rank (distdiag/check/shared_values.py); consolidate
    gets the payloads unchanged, the ranks that posted a value alike holding one object: it reads
    these fields and never changes them (`alike` judges each distinct one once)."""

    def options(self, holder: RankContext | ConsolidationView) -> Any:
        """This probe's options from a RankContext or ConsolidationView: the check always
        fills them in; called directly (tests, the watchdog), the Config's defaults."""
        return holder.options if holder.options is not None else self.Config()  # type: ignore[misc]  # asked only of probes with a Config

    def world_problem(self, world_size: int) -> str | None:
        """Why this world cannot run the probe (bad input if the probe was asked for by name)."""
        if world_size < self.min_world_size:
            return (
                f"WORLD_SIZE must be >= {self.min_world_size} for probe '{self.name}', "
                f"got {world_size}; relaunch with --nproc-per-node {self.min_world_size} or more"
            )
        return None

    def options_problem(self, options: Any, world_size: int) -> str | None:
        """Why these options cannot run in this world (a size that must divide it): bad input."""
        return None

    checks_a_model: ClassVar[bool] = False
    """True: the probe checks a model, data or layout: the target's hooks, or without a target a
    built-in workload of distdiag's own; such a PASS then says it checked the stack, not the
    user's model (the table and the verdict line say so: distdiag/check/consolidate.py)."""

    preload: ClassVar[tuple[str, ...]] = ()
    """Modules `run` imports that cost seconds (FSDP2, DTensor, DCP): `distdiag check` imports
    those of the planned probes once per node, before it forks the ranks
    (distdiag.launcher.forkrun); a rank that was not forked imports them when it runs."""

    private_apis: ClassVar[tuple[str, ...]] = ()
    """Private torch APIs the probe relies on, as "module:attribute"; when one is missing in
    this torch (they move between releases), the probe skips with the reason instead of
    raising."""

    def skip_reason(self, ctx: RankContext) -> str | None:
        """Why the probe skips on this machine (missing hardware, missing torch API), or None."""
        return None

    def missing_api_reason(self) -> str | None:
        """The first private torch API of `private_apis` this torch lacks, as a skip reason."""
        import importlib

        for spec in self.private_apis:
            module, _, attr = spec.partition(":")
            try:
                found = importlib.import_module(module)
                if attr:
                    getattr(found, attr)
            except (ImportError, AttributeError):
                import torch

                return (
                    f"probe '{self.name}' needs {module}{'.' + attr if attr else ''}, "
                    f"a private torch API missing in torch {torch.__version__}"
                )
        return None

    @abc.abstractmethod
    def run(self, ctx: RankContext) -> dict[str, Any]:
        """Do this rank's part; return a JSON-able payload."""

    def consolidate(self, payloads: dict[int, dict[str, Any]], view: ConsolidationView) -> ProbeResult:
        """Turn every rank's payload into one result; the default merges local findings."""
        return ProbeResult.from_findings(self.name, merge_local_findings(payloads))


class LocalFinding(TypedDict):
    """A finding one rank made about itself, posted in its payload's `findings` (as JSON)."""

    severity: str
    issue: str
    evidence: str
    fix: str
    confidence: float


def local_finding(severity: str, issue: str, evidence: str = "", fix: str = "", confidence: float = 1.0) -> LocalFinding:
    """A finding one rank made about itself, for `merge_local_findings` to combine."""
    return {"severity": severity, "issue": issue, "evidence": evidence, "fix": fix, "confidence": confidence}


def merge_local_findings(payloads: dict[int, dict[str, Any]]) -> list[Finding]:
    """Combine the `findings` lists of every rank's payload: one finding per issue, with ranks."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for rank in sorted(payloads):
        for item in payloads[rank].get("findings", []):
            key = (item["severity"], item["issue"])
            entry = merged.setdefault(key, {**item, "ranks": [], "evidences": {}})
            entry["ranks"].append(rank)
            if item.get("evidence"):
                entry["evidences"].setdefault(item["evidence"], []).append(rank)
    out = []
    for entry in merged.values():
        evidences = entry.pop("evidences")
        if len(evidences) == 1:
            evidence = next(iter(evidences))
        else:
            evidence = "\n".join(f"rank {','.join(map(str, rs))}: {ev}" for ev, rs in evidences.items())
        out.append(
            Finding(
                severity=entry["severity"],
                issue=entry["issue"],
                evidence=evidence,
                ranks=entry["ranks"],
                fix=entry.get("fix", ""),
                confidence=entry.get("confidence", 1.0),
            )
        )
    return out


def group_ranks(ranks: Iterable[int], value: Callable[[int], K]) -> dict[K, list[int]]:
    """Ranks grouped by value(rank), groups in order of first appearance."""
    groups: dict[K, list[int]] = {}
    for r in ranks:
        groups.setdefault(value(r), []).append(r)
    return groups


def group_values(ranks: list[int], values: list[K]) -> dict[K, list[int]]:
    """group_ranks with each rank's value already taken (values[i] is ranks[i]'s): one group
    without a per-rank step when all are equal, the common case at 16k ranks (issue 21)."""
    if values and len(set(values)) == 1:
        return {values[0]: list(ranks)}
    groups: dict[K, list[int]] = {}
    for r, v in zip(ranks, values, strict=True):
        groups.setdefault(v, []).append(r)
    return groups


def minority_ranks(groups: Mapping[K, list[int]]) -> list[int]:
    """The ranks outside the largest group (every rank when no group is larger than the others)."""
    ordered = sorted(groups.values(), key=len, reverse=True)
    if len(ordered[0]) == len(ordered[1]):
        return sorted(r for g in ordered for r in g)
    return sorted(r for g in ordered[1:] for r in g)


def alike(ranks: list[int], values: Sequence[V]) -> list[tuple[V, list[int]]]:
    """(value, the ranks holding that very object) per distinct object, in order of first
    appearance (values[i] is ranks[i]'s). Ranks that posted a shared field alike hold one object
    (distdiag/check/shared_values.py): a probe judges each distinct one once, not 16k times."""
    by_id: dict[int, tuple[V, list[int]]] = {}
    for r, v in zip(ranks, values, strict=True):
        held = by_id.get(id(v))
        if held is None:
            by_id[id(v)] = (v, [r])
        else:
            held[1].append(r)
    return list(by_id.values())


def group_alike(pairs: Iterable[tuple[K, list[int]]]) -> dict[K, list[int]]:
    """group_values over `alike`'s classes, each judged once: (value, ranks) pairs in order of
    their first rank -> value -> its ranks in ascending order, groups in order of first rank."""
    groups: dict[K, list[int]] = {}
    merged = False
    for value, ranks in pairs:
        held = groups.get(value)
        if held is None:
            groups[value] = list(ranks)
        else:
            held += ranks
            merged = True
    if merged:
        for value in groups:
            groups[value].sort()
    return groups
