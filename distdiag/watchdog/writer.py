"""The writing rank's job once a hang or desync is declared: gather, analyse, write, print.

Everything comes through the store (no shared filesystem): each live rank's snapshot, the
final snapshots of ranks that already left their watched region, the exceptions ranks
raised, and the rank table. Ranks that posted nothing are looked at from outside when they
run on this host (gone, stopped, alive but silent). The result is a distdiag Report (the same
schema as the check's), written atomically to DUMP_DIR/hang-report.json and shared through
the store so local rank 0 of every other host can keep a copy.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from distdiag.errors import print_line
from distdiag.hang import (
    RankView,
    analyze_hang,
    build_views,
    desync_finding,
    ensure_critical,
    find_desync,
    snapshot_details,
    stack_text,
    state_rows,
)
from distdiag.hang.picture import hang_extras
from distdiag.hang.records import (
    CAUSE_DESYNC,
    Cause,
    EngineView,
    EventKind,
    IncidentEvent,
    RankSnapshot,
    Silence,
    SilentReason,
    Verdict,
    event_of,
)
from distdiag.hang.views import GROUPED_DETAILS_RANKS, group_members
from distdiag.report.model import EXIT_HANG, Finding, ProbeResult, RankInfo, Report, now_iso, verdict_for
from distdiag.report.render import known_hosts, render_report
from distdiag.report.safefile import printable
from distdiag.runtime.blind import blind_spot, mark_blind
from distdiag.runtime.exchange import BATCH
from distdiag.runtime.gcpause import collector_paused
from distdiag.runtime.incident import Incident, collect_histories, collect_snapshots, silent_rank_reasons, write_stamped
from distdiag.runtime.keys import Keys
from distdiag.runtime.nodes import NodeReader, gather_snapshots, node_leaders

__all__ = [
    "gather_and_write", "publish_outcome", "render_hang_report", "excused", "inconsistent_ranks", "typed_snapshots",
    "analyse_and_detail", "REPORT_NAME",
]

REPORT_NAME = "hang-report.json"
log = logging.getLogger("distdiag.watchdog.writer")


def _phase_findings(snaps: dict[int, dict[str, Any]]) -> list[Finding]:
    out = []
    for rank, snap in sorted(snaps.items()):
        for ph in snap.get("phases") or []:
            if ph["for_s"] > ph["budget_s"]:
                out.append(
                    Finding(
                        severity="critical",
                        issue=f"rank {rank} has been in phase '{ph['name']}' for {ph['for_s']:.1f}s, over its budget of {ph['budget_s']:g}s",
                        evidence=stack_text(snap),
                        ranks=[rank],
                        fix=f"if '{ph['name']}' is just slow, give the phase a larger timeout; otherwise the stack shows where it is stuck",
                        confidence=0.85,
                        cause=Cause.PHASE_OVER_BUDGET,
                    )
                )
    return out


def analyse(
    event: IncidentEvent | dict[str, Any],
    merged: dict[int, dict[str, Any]],
    lost: Mapping[int, str],
    errors: dict[int, dict[str, Any]],
    world: int,
    timeout_s: float,
    views: dict[int, RankView] | None = None,
    keep: dict[str, Any] | None = None,
) -> list[Finding]:
    """Findings from every rank's last snapshot (`merged`: final snapshots overlaid by live ones;
    `views`: build_views(merged, lost), when the caller built them already; `keep`: gets the
    rules' wait-for graph, analyze_hang's)."""
    steps = sorted({str(s.get("step")) for s in merged.values() if s.get("step") is not None})
    what = f"step {steps[0]}" if len(steps) == 1 else (f"steps {', '.join(steps[:4])}" if steps else "training")
    findings: list[Finding] = []
    event = event_of(event)
    if event.kind is EventKind.DESYNC:
        located = find_desync(merged)
        if located is not None:
            findings.append(desync_finding(located))
        else:
            mark = event.detail if isinstance(event.detail, dict) else {}
            findings.append(
                Finding(
                    severity="critical",
                    issue=(
                        f"desync on group {mark.get('group')}: at step mark {mark.get('step')} rank {mark.get('rank')} had "
                        f"issued {mark.get('mine')} collectives there and rank {mark.get('ref')} {mark.get('theirs')}, "
                        "with different fingerprints"
                    ),
                    evidence="the point of divergence is older than the fingerprint history kept (DISTDIAG_WATCHDOG_HISTORY)",
                    ranks=[int(mark.get("rank", 0)), int(mark.get("ref", 0))],
                    fix="every rank must issue the same collectives in the same order; raise the history to locate it",
                    confidence=0.6,
                    cause=CAUSE_DESYNC,
                )
            )
        return findings
    findings += _phase_findings(merged)
    findings += analyze_hang(merged, lost, errors, world, what=what, timeout_s=timeout_s, views=views, keep=keep)
    return findings


def _step_summary(snaps: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Steps per rank and the usual step time: lag between ranks, a rank that left the loop."""
    steps = {str(r): s.get("steps") for r, s in sorted(snaps.items()) if s.get("steps") is not None}
    cadences = sorted(s["step_cadence_s"] for s in snaps.values() if s.get("step_cadence_s"))
    sources = sorted({s["step_source"] for s in snaps.values() if s.get("step_source")})
    return {
        "per_rank": steps,
        "source": sources[0] if len(sources) == 1 else sources,
        "usual_step_s": cadences[len(cadences) // 2] if cadences else None,
        "since_step_s": {str(r): s.get("step_for_s") for r, s in sorted(snaps.items()) if s.get("step_for_s") is not None},
        "in_training_loop": {str(r): s.get("in_loop") for r, s in sorted(snaps.items()) if s.get("in_loop") is not None},
        "loop": sorted({s["loop"] for s in snaps.values() if s.get("loop")}),
        # each rank's DataLoader passes (batches drawn, ran out): the evidence of uneven data
        "data_loaders": {str(r): s["loaders"] for r, s in sorted(snaps.items()) if s.get("loaders")},
    }


def render_hang_report(report: Report, exit_code: int | None = None) -> str:
    """The report as text (`exit_code`: the code the command returns, when not the report's)."""
    hosts = known_hosts(report)
    if report.probes and report.probes[0].name == "flight_recorder":
        title = "distdiag hang-report: from flight-recorder dumps"
    else:
        title = (f"distdiag watchdog: {printable(report.outcome)} report, {report.world_size} rank(s) on "
                 f"{len(hosts) or 1} host(s), written by rank {report.written_by}{_lead_words(report)}")
    return render_report(report, exit_code=exit_code, title=title)


def _lead_words(report: Report) -> str:
    """'; lead: uneven_data on rank 1' where the lead's cause is not the outcome the title names
    (a lost_rank report whose lead is the short rank that a peer's abort followed)."""
    from distdiag.report.render import format_ranks

    lead = next((f for p in report.probes for f in p.findings if f.severity in ("critical", "error")), None)
    if lead is None or not lead.cause or not lead.ranks:
        return ""
    cause = printable(str(lead.cause))
    return "" if cause == printable(report.outcome) else f"; lead: {cause} on {format_ranks(lead.ranks)}"


Typed = dict[int, tuple[dict[str, Any], RankSnapshot]]
"""Snapshots typed while they came in, by rank: (the posted dict, its RankSnapshot)."""

GRACE_PER_RANK_S = 0.002
"""What the snapshot grace may grow by per rank while snapshots keep coming in (the check's
sentinel allows the same): 16k ranks notice the incident at their own tick (0.66 s apart
there), build and post through one store, and their node leaders gather; with a flat 2 s,
about one in nine of them was called lost in benchmarks/bench_scale.py --from-declaration."""


def _wait_for_snapshots(incident: Incident, infos: dict[int, RankInfo], *, host: str, grace_s: float,
                        ahead: NodeReader | None = None, typed: Typed | None = None) -> None:
    """Until every rank posted a snapshot (live or final), or grace_s passed with none new
    coming in, and never longer than grace_s + GRACE_PER_RANK_S a rank: the grace counts from
    the last snapshot that came in, so a large job whose ranks are still posting is waited for
    and a silent rank costs grace_s after the others. The writer's progress moves with each
    snapshot that comes in. `ahead`: node values are read and unpacked as they come (and typed
    into `typed`), in the time the writer waits anyway.

    What came in is counted (the counts every post bumps: two requests a poll); which ranks
    exactly is looked up only once the counts say every rank or all but this host's posted
    (looking among 16k keys every 50 ms cost the writer 1 s of CPU at 16k ranks); up to BATCH
    ranks, every poll as before."""
    ex, world = incident.ex, incident.world
    start = time.monotonic()
    cap, last_news, looked = start + grace_s + GRACE_PER_RANK_S * world, start, start - 1.0
    seen = -1
    here = sum(1 for i in infos.values() if i.host == host)
    while True:
        if ahead is not None:
            _read_ahead(ahead, typed)
        posted = min(world, ex.count(incident.keys.snap) + ex.count(Keys.FINAL))  # a rank may have both
        now = time.monotonic()
        news = posted != seen
        if news:
            seen, last_news = posted, now
            incident.advance(f"gathered {seen} of {world} snapshots")
        missing = None
        if world <= BATCH:  # a few requests: look every poll, as the counts say nothing of who
            missing = _missing(incident, ahead)
        elif (world - posted <= here or posted >= world) and (news or now - looked >= 0.5):
            missing, looked = _missing(incident, ahead), now  # past BATCH ranks: when the counts say it may be over
        if missing == [] or now >= cap or now >= last_news + grace_s:
            break
        # A rank on this host that is gone or stopped will never answer: do not wait for it.
        # (the host test first: it is free, the process lookups are not)
        if missing and all(infos.get(r) is not None and infos[r].host == host for r in missing) and all(
            why.reason is not SilentReason.ALIVE_SILENT
            for why in silent_rank_reasons(missing, infos, host, who="watchdog").values()
        ):
            break
        time.sleep(0.05)


def _missing(incident: Incident, ahead: NodeReader | None) -> list[int]:
    """The ranks that posted no snapshot, live or final (those a node value brought did)."""
    ex = incident.ex
    known = ahead.snaps if ahead is not None else {}
    rest = [r for r in range(incident.world) if r not in known]
    have = set(ex.present(incident.keys.snap, rest)) if rest else set()
    rest = [r for r in rest if r not in have]
    finals = set(ex.present(Keys.FINAL, rest)) if rest else set()
    return [r for r in rest if r not in finals]


def _read_ahead(ahead: NodeReader, typed: Typed | None) -> None:
    """The node values posted since the last look, unpacked (and typed into `typed`)."""
    try:
        new = ahead.read_new()
    except Exception as exc:  # noqa: BLE001 - reading ahead is a head start: the gather reads them anyway
        log.debug("could not read the node values ahead: %s", exc)
        return
    if typed is not None:
        for r in new:
            typed[r] = (ahead.snaps[r], RankSnapshot.from_dict(ahead.snaps[r]))


def _gather(
    incident: Incident, infos: dict[int, RankInfo], *, host: str, grace_s: float, event: IncidentEvent | None = None,
    typed: Typed | None = None,
) -> tuple[dict[int, dict[str, Any]], dict[int, Silence], dict[int, dict[str, Any]]]:
    """(merged, lost, errors): every rank's last snapshot (final ones overlaid by live ones),
    why each rank that posted none is silent, and the exceptions ranks raised. The long
    histories come with them where the analysis needs them (`_history_ranks`). `typed` gets
    the snapshots typed while they came in (typed_snapshots takes those still as posted)."""
    ex, world = incident.ex, incident.world
    labels: dict[str, str] = {}
    ahead = NodeReader(incident, labels)
    _wait_for_snapshots(incident, infos, host=host, grace_s=grace_s, ahead=ahead, typed=typed)
    leaders = node_leaders(infos, incident.rank)
    gathered: dict[str, int] = {}
    snaps = gather_snapshots(incident, cache=labels, leaders=leaders, stats=gathered, ahead=ahead)
    final_snaps = {r: s for r, s in collect_snapshots(ex, Keys.FINAL, cache=labels).items() if r not in snaps}
    errors = {int(r): e for r, e in ex.collect(Keys.ERROR).items()}
    missing = [r for r in range(world) if r not in snaps and r not in final_snaps]
    lost = silent_rank_reasons(missing, infos, host, who="watchdog")
    merged = dict(final_snaps)
    merged.update(snaps)
    wanted = _history_ranks(event, merged, world)
    for key, source in ((incident.keys.snap, snaps), (Keys.FINAL, final_snaps)):
        ranks = sorted(source) if wanted is None else sorted(wanted & set(source))
        if ranks:
            for r, history in collect_histories(ex, key, ranks, cache=labels).items():
                merged[r]["history"] = history
    gathered["histories"] = sum(1 for s in merged.values() if "history" in s)
    incident.gathered = gathered
    return merged, lost, errors


HISTORY_ALL_RANKS = 1024
"""Up to this many ranks the writer reads every rank's long history (512 records by default)
with the snapshots; past it only where the analysis needs them (`_history_ranks`): 16k
histories are 8M records, minutes to read and analyse."""
HISTORY_MAX_RANKS = 2048
"""Past HISTORY_ALL_RANKS, the most ranks whose histories the writer reads."""


def _history_ranks(event: IncidentEvent | None, merged: dict[int, dict[str, Any]], world: int) -> set[int] | None:
    """The ranks whose long history the writer reads: all (None) up to HISTORY_ALL_RANKS; past
    it the members of the groups where the ranks' recent records disagree (a collective that
    differs at one sequence number, where a desync shows) and the ranks a desync event names."""
    if world <= HISTORY_ALL_RANKS:
        return None
    seen: dict[tuple[str, int], Any] = {}
    odd: set[str] = set()
    for snap in merged.values():
        for c in snap.get("recent") or ():
            group, seq, fp = c.get("group"), c.get("seq"), c.get("fp")
            if isinstance(group, str) and isinstance(seq, int):
                known = seen.setdefault((group, seq), fp)
                if known != fp and str(known) != str(fp):  # str() only where they differ: 131k records at 16k ranks
                    odd.add(group)
    wanted: set[int] = set()
    detail = event_of(event).detail if event is not None else None
    if isinstance(detail, dict):
        wanted |= {int(detail[k]) for k in ("rank", "ref") if isinstance(detail.get(k), int)}
        if isinstance(detail.get("group"), str):
            odd.add(detail["group"])
    for group in sorted(odd):
        wanted |= set(group_members(group, world) or [])
    return set(sorted(wanted)[:HISTORY_MAX_RANKS])


def excused(event: IncidentEvent | dict[str, Any], merged: Mapping[int, RankSnapshot]) -> str | None:
    """Why a declared timeout is no hang once every rank's snapshot is in, else None: a live
    rank inside a declared phase with budget left (a checkpoint excuses its own slowness) or
    still importing (a job still starting). A rank in a phase that is itself blocked inside a
    collective (`blocked_in_phase`) excuses nobody: it is waiting, not working for the others. The declaring rank may have missed it: phases and
    imports reach the store on the watchdog thread's next tick, later still on a busy CPU.
    A phase over its budget anywhere keeps the hang."""
    if event_of(event).kind is not EventKind.TIMEOUT:
        return None
    live = {r: snap for r, snap in sorted(merged.items()) if not snap.finished}
    if any(s.over_budget() for s in live.values()):
        return None
    for rank, snap in live.items():
        if snap.importing:
            return f"rank {rank} is still importing modules (the job is starting)"
        if snap.extra.get("blocked_in_phase"):
            continue  # it waits in a collective itself: its phase is not work the others wait for
        for ph in snap.phases:
            return f"rank {rank} is in phase '{ph.name}' ({ph.for_s:.1f}s of its {ph.budget_s:g}s budget)"
    return None


REREAD_WAIT_S = 3.0
"""How long the writer waits for the new snapshot of a rank it asked to re-read."""


def inconsistent_ranks(merged: Mapping[int, RankSnapshot]) -> list[int]:
    """Ranks whose recorder shows them inside collective #k of a group on which every other
    member has completed #k or later: nobody is left for it to wait for, so the snapshot
    contradicts itself (a read while the recorder was being updated, gloo marking completions
    late): it must be re-read, not judged. `merged`: the typed snapshots (typed_snapshots).

    Only *every* other member counts: a broadcast's receivers complete once the root's data
    reached them, so on gloo the root of a broadcast one receiver never entered sits inside #k
    that the other receivers completed - it waits for that one, which has completed fewer.

    Linear in ranks x their groups: what a rank is compared with is the least any *other*
    member completed, the group's lowest count, or its second lowest where the rank itself
    holds the lowest (comparing every pair was ranks x group size: 8.4M steps at 16k ranks)."""
    engines = {r: s.engine for r, s in sorted(merged.items())}
    done: dict[str, dict[int, int]] = {}
    for rank, engine in engines.items():
        for g in engine.groups if engine is not None and engine.ok else []:
            done.setdefault(g.group, {})[rank] = g.completed
    lows = {group: _low_two(counts) for group, counts in done.items()}
    out = []
    for rank, engine in engines.items():
        for g in engine.groups if engine is not None and engine.ok else []:
            if not g.inside:
                continue
            low_rank, first, second = lows[g.group]
            others = second if low_rank == rank else first
            if others is not None and others >= g.enqueued:
                out.append(rank)
                break
    return out


def _low_two(counts: dict[int, int]) -> tuple[int, int | None, int | None]:
    """(the rank with the lowest count, the lowest, the second lowest) of rank -> count;
    with a tie for the lowest the second equals it."""
    low_rank, first, second = -1, None, None
    for rank, c in counts.items():
        if first is None or c < first:
            low_rank, first, second = rank, c, first
        elif second is None or c < second:
            second = c
    return low_rank, first, second


def typed_snapshots(merged: dict[int, dict[str, Any]], ahead: Typed | None = None) -> dict[int, RankSnapshot]:
    """Every snapshot typed once for the incident, by rank: the re-read, the excuse, the views
    and the table all read these (each typed them again: four passes of ~0.15 s at 16k ranks).
    They share the posted dicts' nested values (from_dict copies nothing deep). `ahead`: those
    typed while the snapshots came in (`_read_ahead`), taken where the rank's dict is the one
    typed then and still without a long history."""
    ahead = ahead or {}
    out = {}
    for r, s in sorted(merged.items()):
        was, t = ahead.get(r, (None, None))
        out[r] = t if t is not None and was is s and "history" not in s else RankSnapshot.from_dict(s)
    return out


def _reread(
    incident: Incident, merged: dict[int, dict[str, Any]], *, rank: int, own_snapshot: Any, wait_s: float,
    records: dict[int, RankSnapshot] | None = None,
) -> None:
    """Ask each rank whose snapshot contradicts itself for a new one (the writer re-reads its
    own); a rank still inconsistent after that keeps its snapshot without the recorder's view,
    so the rules judge it from its stack and the wrappers' records, never from a stale count.
    `records` (typed_snapshots of `merged`) follow every snapshot replaced or changed here."""
    records = typed_snapshots(merged) if records is None else records
    bad = inconsistent_ranks(records)
    if not bad:
        return
    if rank in bad and own_snapshot is not None:
        merged[rank] = own_snapshot().to_dict()
        records[rank] = RankSnapshot.from_dict(merged[rank])
    incident.ask_again([r for r in bad if r != rank])
    end = time.monotonic() + wait_s
    waiting = [r for r in bad if r != rank]
    while waiting and time.monotonic() < end:
        time.sleep(0.05)
        for r, snap in incident.snapshots(waiting).items():
            if snap.reread:
                merged[r] = snap.to_dict()
                records[r] = RankSnapshot.from_dict(merged[r])
                waiting.remove(r)
    for r in inconsistent_ranks(records):
        if r in bad:
            merged[r]["engine"] = EngineView.stale(
                "the flight recorder's counts contradicted the other ranks' twice (a rank inside a "
                "collective its peers had completed): its counts left out of the analysis, its entries kept",
                (merged[r].get("engine") or {}).get("entries"),
            ).to_dict()
            records[r] = RankSnapshot.from_dict(merged[r])


def _details(
    event: IncidentEvent | dict[str, Any],
    merged: dict[int, dict[str, Any]],
    lost: Mapping[int, str],
    errors: dict[int, dict[str, Any]],
    world: int,
    infos: dict[int, RankInfo] | None = None,
    views: dict[int, RankView] | None = None,
    findings: list[Finding] | None = None,
) -> dict[str, Any]:
    """The watchdog probe's details: the ranks' table, the event, the snapshots, steps, errors.
    `views`: build_views(merged, lost), when the analysis built them already; `findings`: past
    GROUPED_DETAILS_RANKS the recorder's entries are kept for the ranks they name
    (`_recorder_ranks`)."""
    keep = _recorder_ranks(merged, findings, event) if len(merged) > GROUPED_DETAILS_RANKS else None
    rows = state_rows(merged, lost, world, infos, views=views)
    for row in rows:
        s = merged.get(row["rank"])
        row["step"] = "-" if s is None or s.get("step") is None else s.get("step")
        row["steps"] = "-" if s is None or s.get("steps") is None else s.get("steps")
    return {
        "table:ranks at the end": rows,
        "event": event_of(event).to_dict(),
        **snapshot_details(merged),
        "flight_recorder": {
            str(r): (s.get("engine") or {}).get("entries") for r, s in sorted(merged.items())
            if (s.get("engine") or {}).get("entries") and (keep is None or r in keep)
        },
        **({"flight_recorder_note": (
            f"the recorder's last entries of the {len(keep)} rank(s) the findings name first; the other ranks' are "
            "left out (each rank's position on each group is in the flight recorder's table)")} if keep is not None else {}),
        "steps": _step_summary(merged),
        "errors": {str(r): e for r, e in errors.items()},
    }


RECORDER_RANKS_MAX = 64
"""Past GROUPED_DETAILS_RANKS, the most ranks whose recorder entries (their last 32
collectives with call sites, ~9 KB of report a rank) the report keeps: every rank's made a
786 MB report and a 3.5 GB writer at 16k ranks (benchmarks/bench_scale.py --from-declaration)."""


def _recorder_ranks(merged: dict[int, Any], findings: list[Finding] | None,
                    event: IncidentEvent | dict[str, Any]) -> set[int]:
    """The ranks whose recorder entries a large report keeps: those the findings name, the
    most severe first, then the declaring rank, at most RECORDER_RANKS_MAX."""
    order = {"critical": 0, "error": 1, "warning": 2}
    named: list[int] = []
    for f in sorted(findings or [], key=lambda f: order.get(f.severity, 3)):
        named += [r for r in f.ranks or [] if r in merged]
    rank = event_of(event).rank
    named += [rank] if isinstance(rank, int) and rank in merged else []
    return set(list(dict.fromkeys(named))[:RECORDER_RANKS_MAX])


def analyse_and_detail(
    event: IncidentEvent | dict[str, Any],
    merged: dict[int, dict[str, Any]],
    lost: Mapping[int, str],
    errors: dict[int, dict[str, Any]],
    world: int,
    timeout_s: float,
    *,
    infos: dict[int, RankInfo] | None = None,
    records: dict[int, RankSnapshot] | None = None,
) -> tuple[list[Finding], dict[str, Any]]:
    """(findings, the probe's details): the rules and the ranks' table read one set of views,
    built once from the typed snapshots (`records`: typed_snapshots(merged), when typed already)."""
    views = build_views(merged, lost, records)
    keep: dict[str, Any] = {}
    findings = analyse(event, merged, lost, errors, world, timeout_s, views=views, keep=keep)
    findings = mark_blind(findings, blind_spot(snaps=merged.values()))  # NCCL blocking wait: the recorder does not move
    details = _details(event, merged, lost, errors, world, infos, views=views, findings=findings)
    details.update(hang_extras(findings, views, lost, errors, world, keep.get("graph")))  # `hang-report --graph` draws it
    return findings, details


def _outcome(event: IncidentEvent | dict[str, Any], lost: Mapping[int, str], findings: list[Finding] | None = None) -> str:
    """The report's outcome: a desync also when a declared hang's lead finding is one (the
    ranks' histories located it: a watchdog thread starved by a loaded CPU can declare the
    hang that follows a desync before it compares the step marks)."""
    kind = event_of(event).kind
    lead = next((f for f in findings or [] if f.severity == "critical"), None)
    if kind is EventKind.DESYNC or (not lost and kind is EventKind.TIMEOUT and lead is not None and lead.cause == CAUSE_DESYNC):
        return "desync"
    return "lost_rank" if lost else ("raised" if kind is EventKind.RAISED else "hang")


def _summary(findings: list[Finding]) -> str:
    """The first critical finding's issue, with how many more critical or error findings there are."""
    top = next((f for f in findings if f.severity == "critical"), findings[0])
    more = len([f for f in findings if f.severity in ("critical", "error")]) - 1
    return top.issue + (f" (+{more} more finding(s))" if more > 0 else "")


_WORKING = "_distdiag_working"
"""The attribute under which gather_and_write leaves what it worked on for publish_outcome to
drop once the verdict and the report are out."""
_WRITTEN_JSON = "_distdiag_written_json"
"""The attribute under which _write_and_print leaves the report's JSON for publish_outcome:
a 16k-rank report takes ~0.5 s to serialise, and the shared copy is the file's text."""


def _write_and_print(report: Report, *, dump_dir: str) -> str:
    """Write the report (atomically, stamped with the launch id) and print it; where it is, or why it is not."""
    text, written, why = write_stamped(report, os.path.join(dump_dir, REPORT_NAME))
    setattr(report, _WRITTEN_JSON, text)
    where = written if written is not None else f"(not written: {why})"
    shown = render_hang_report(report)
    print_line(f"{shown}\nhang report: {where}")
    return where


def publish_outcome(incident: Incident, report: Report | None, *, excuse: str | None, dump_dir: str) -> None:
    """The verdict first, then the report's JSON for the other nodes' copies (Incident.publish):
    the text gather_and_write wrote to the file, not serialised again. Without a report (the
    writer failed) the verdict still comes, so nobody waits for a writer that has given up."""
    if report is None:
        verdict = Verdict(EXIT_HANG, incident.rank, incident.seat.host, incident.seat.node, outcome="hang", excused=excuse,
                          summary="" if excuse else "the writer could not build the report (see its stderr)")
        incident.publish_verdict(verdict)
        return
    with collector_paused():  # the report's objects are still young: a collection now walks them all
        text = report.__dict__.pop(_WRITTEN_JSON, None) or report.to_json()
        incident.publish(report, text, os.path.abspath(os.path.join(dump_dir, REPORT_NAME)))
        report.__dict__.pop(_WORKING, None)  # freed here, after the verdict


def gather_and_write(
    incident: Incident,
    *,
    event: IncidentEvent,
    host: str,
    timeout_s: float,
    grace_s: float,
    dump_dir: str,
    config: dict[str, Any],
    started: float,
    own_snapshot: Any = None,
) -> tuple[Report | None, dict[int, Silence], str | None]:
    """Wait (bounded) for snapshots, re-read the inconsistent ones, analyse, write the report
    and print it; (report, lost, None), or (None, {}, why) when the snapshots excuse the
    declared timeout (`excused`). `own_snapshot()` takes the writer's snapshot again. The
    caller publishes the verdict and the report (publish_outcome)."""
    world, rank = incident.world, incident.rank
    with collector_paused():  # 16k ranks' rows parsed at once: young objects each collection would walk
        infos = {r: RankInfo.from_dict(v) for r, v in incident.ex.collect(Keys.INFO).items()}
    typed: Typed = {}
    with collector_paused():  # 16k snapshots parsed at once: the same
        merged, lost, errors = _gather(incident, infos, host=host, grace_s=grace_s, event=event, typed=typed)
    with collector_paused():
        records = typed_snapshots(merged, typed)
        _reread(incident, merged, rank=rank, own_snapshot=own_snapshot, wait_s=REREAD_WAIT_S, records=records)
        reason = excused(event, records)
        if reason is None and event.kind is EventKind.TERMINATED and not errors:
            reason = _ended_from_outside(lost)
        if reason is not None:
            return None, {}, reason
        with incident.moving(f"analysing {len(merged)} snapshot(s)"):
            findings, details = analyse_and_detail(event, merged, lost, errors, world, timeout_s, infos=infos, records=records)
        # How the snapshots came: through node leaders (distdiag/runtime/nodes.py) or one by one.
        details["gathered"] = incident.gathered
        report = _report(event, findings, details, lost, infos, world=world, rank=rank, timeout_s=timeout_s,
                         config=config, started=started)
        incident.advance("writing the report")
        _write_and_print(report, dump_dir=dump_dir)
        # Freed after the verdict is out (publish_outcome), not on return: 16k snapshots, their
        # typed copies and the rank rows are millions of objects, ~0.12 s to free.
        setattr(report, _WORKING, (merged, records, infos))
    return report, lost, None


def _ended_from_outside(lost: Mapping[int, Silence]) -> str | None:
    """Why a SIGTERM incident is no failure, or None: every rank answered; or the only silent
    ranks never checked in and each is a live worker of this rank's own launcher (the same
    torchrun agent), i.e. it was still starting when the job was ended, not dead at start-up."""
    if not lost:
        return "every rank answered after the launcher's SIGTERM: the job was ended from outside, no rank failed"
    if any(s.reason is not SilentReason.NEVER_CHECKED_IN for s in lost.values()):
        return None
    starting = _live_sibling_ranks()
    if not set(lost) <= starting:
        return None
    return (f"every rank that had checked in answered after the launcher's SIGTERM and rank(s) "
            f"{', '.join(map(str, sorted(lost)))} were still starting (alive): the job was ended from outside")


def _live_sibling_ranks() -> set[int]:
    """The global ranks of the live workers this rank's launcher (its parent process) started."""
    import psutil

    out: set[int] = set()
    try:
        siblings = psutil.Process(os.getppid()).children()
    except (psutil.Error, OSError):
        return out
    for p in siblings:
        try:
            if p.pid == os.getpid() or p.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                continue
            rank = p.environ().get("RANK", "")
        except (psutil.Error, OSError):
            continue
        if rank.isdigit():
            out.add(int(rank))
    return out


def _report(
    event: IncidentEvent, findings: list[Finding], details: dict[str, Any], lost: dict[int, Silence],
    infos: dict[int, RankInfo], *, world: int, rank: int, timeout_s: float, config: dict[str, Any], started: float,
) -> Report:
    """The watchdog's report: the findings (led by a critical one), the details, the rank table."""
    ensure_critical(
        findings, f"no progress for {timeout_s:g}s: {event.detail_line()}",
        "ranks' states are in the table below", "see the per-rank stacks",
    )
    result = ProbeResult.from_findings("watchdog", findings, details=details, duration_s=time.monotonic() - started)
    ranks = [infos.get(r, RankInfo(r, "?", -1, -1, "?", -1)) for r in range(world)]
    return Report(
        world_size=world, probes=[result], ranks=ranks, exit_code=EXIT_HANG, verdict=verdict_for(EXIT_HANG, [result]),
        outcome=_outcome(event, lost, findings), summary=_summary(findings),
        restart_count=int(config.get("restart_count", 0)), run_id=str(config.get("run_id", "")),
        created=now_iso(),
        duration_s=time.monotonic() - started, config=config, written_by=rank,
    )


