"""A hang report from one flight-recorder dump per rank (`distdiag hang-report DIR`).

The files are read safely (hang/dumps.py), each becomes its rank's groups by members
(hang/dumpgroups.py), and the hang rules that read live snapshots read these: who never
entered the collective the others are in, a desync in the entries, a stall. A rank with no
dump file at all is a suspect (lost). The report's table shows, for every group the
recorder saw (send/recv included) and every rank, the last op with its sizes and dtypes.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from distdiag.hang.dumpblame import findings_from, where_in_dump
from distdiag.hang.dumpgroups import RankDump, engine_view, group_label, infer_members, normalise, op_text, world_of
from distdiag.hang.dumps import MAX_RANK, DumpError, load_dump, rank_of
from distdiag.hang.frontier import attribute
from distdiag.hang.records import SilentReason
from distdiag.report.model import EXIT_HANG, EXIT_PASS, Finding, ProbeResult, Report, verdict_for
from distdiag.report.render import format_ranks

__all__ = ["read_dumps", "read_folder", "recorder_of", "dump_files", "skipped_line", "rank_dumps", "report_from_dumps", "groups_table"]

def read_dumps(files: list[Path], root: Path | None = None) -> dict[int, dict[str, Any]]:
    """rank -> raw dump, one file per rank. Raises DumpError (one line) or OSError."""
    return read_folder(files, root, skip=False)[0]


MAX_FILES = 1 << 20
"""Files looked at in a dump folder (a job of a million ranks at most, one file each)."""


def dump_files(path: Path) -> list[Path]:
    """The files that may be dumps: `path` itself, or the files in the folder and in its
    subfolders (one folder per rank, or per host holding its ranks' folders), hidden ones left
    out, sorted; symlinks to folders are not followed."""
    if path.is_file():
        return [path]
    out: list[Path] = []
    todo = [(path, 0)]
    while todo and len(out) <= MAX_FILES:
        folder, depth = todo.pop()
        for p in sorted(folder.iterdir()):
            if p.name.startswith("."):
                continue
            if p.is_file():
                out.append(p)
            elif p.is_dir() and not p.is_symlink() and depth < 2:
                todo.append((p, depth + 1))
    return sorted(out)


Raw = dict[int, dict[str, Any]]


def recorder_of(dump: dict[str, Any]) -> str:
    """Which recorder wrote a dump: NCCL's and gloo's each number their own groups and write
    their own file ('nccl', 'gloo', ...: the prefix of its entries' names), '?' when it says not."""
    names = Counter(str(e.get("profiling_name", "")).partition(":")[0] for e in dump.get("entries") or []
                    if ":" in str(e.get("profiling_name", "")))
    if names:
        return names.most_common(1)[0][0]
    return "nccl" if dump.get("comm_lib_version") or dump.get("nccl_version") else "?"


def read_folder(files: list[Path], root: Path | None = None, skip: bool = True,
                roots: dict[Path, Path | None] | None = None) -> tuple[Raw, list[tuple[Path, str]], dict[str, Raw]]:
    """(rank -> raw dump, [(file, why it was skipped)], other recorder -> rank -> raw dump).

    `root`: the folder the files were listed from (a file in a subfolder may be named by its
    folder: one folder per rank); `roots`: that folder per file, where they came from several.

    With `skip`, a file that is not a readable dump (a log, a README, a broken or refused pickle)
    is skipped when another file is one; when none is, the first file's problem is raised
    (DumpError, one line). Dumps of one rank by two recorders (NCCL's and gloo's) are kept apart:
    the recorder with most dumps comes first, the others are returned by name."""
    found: list[tuple[int, str, dict[str, Any], Path]] = []
    skipped: list[tuple[Path, str]] = []
    for file in files:
        try:
            dump = load_dump(file)
            top = roots.get(file, root) if roots is not None else root
            rank = rank_of(file, dump, folder_per_rank=top is not None and file.parent != top)
        except DumpError as exc:
            if not skip:
                raise
            skipped.append((file, str(exc)))
            continue
        found.append((rank, recorder_of(dump), dump, file))
    if not found and skipped:
        raise DumpError(skipped[0][1])
    by: dict[str, dict[int, tuple[dict[str, Any], Path]]] = defaultdict(dict)
    counts = Counter(rec for _, rec, _, _ in found if rec != "?")
    # most dumps first; on a tie NCCL's (its pg_config carries the members)
    order = sorted(counts, key=lambda rec: (-counts[rec], rec != "nccl", rec)) or ["?"]
    for rank, rec, dump, file in found:
        place = next((r for r in order if rank not in by[r]), None) if rec == "?" else rec
        if place is None or rank in by[place]:
            first = next(by[r][rank][1] for r in order if rank in by[r])
            raise DumpError(f"{first} and {file} are both dumps of rank {rank}: pass one dump per rank "
                            "(a directory holding both the pickle and the JSON form of a dump has two)")
        by[place][rank] = (dump, file)
    sets = {rec: {rank: d for rank, (d, _) in by[rec].items()} for rec in order if by[rec]}
    main = sets.pop(order[0], {})
    return main, skipped, sets


def skipped_line(skipped: list[tuple[Path, str]], root: Path) -> str:
    """One line naming the files that were not read as dumps, and why the first was not."""
    def name(p: Path) -> str:
        try:
            return str(p.relative_to(root)) if p != root else p.name
        except ValueError:
            return str(p)
    names = [name(p) for p, _ in skipped]
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    why = skipped[0][1].replace(str(skipped[0][0]), name(skipped[0][0]))
    return f"distdiag: skipped {len(names)} file(s) that are not flight-recorder dumps: {shown} ({why})"


def rank_dumps(raw: dict[int, dict[str, Any]], world_size: int | None = None) -> tuple[dict[int, RankDump], int, list[str]]:
    """(rank -> normalised dump, world size, notes). Raises DumpError for a world no job has.

    `world_size`: the job's size when the dumps do not say it (gloo's carry no membership)."""
    dumps = {rank: normalise(rank, dump) for rank, dump in sorted(raw.items())}
    seen = world_of(dumps)
    if seen > MAX_RANK:
        raise DumpError(f"the dumps name rank {seen - 1} (in a group's members): no job has {MAX_RANK} ranks; "
                        "these are not flight-recorder dumps of one job")
    if world_size is not None and not seen <= world_size <= MAX_RANK:
        raise DumpError(f"--world-size must be from {seen} (the dumps name rank {seen - 1}) to {MAX_RANK}, got {world_size}")
    world = world_size or seen
    notes = infer_members(dumps, world)
    if notes and world_size is None:
        notes.append(f"nor do they say how many ranks the job has: taken as {world} (the highest rank seen + 1), so a "
                     "higher rank that wrote no dump is not seen; pass --world-size N")
    for d in dumps.values():
        notes += d.notes
    return dumps, world, notes


def groups_table(dumps: dict[int, RankDump], world: int) -> list[dict[str, Any]]:
    """One row per group and rank: the last op recorded, its sizes and dtypes, the position."""
    rows = []
    keyed = sorted({g.key for d in dumps.values() for g in d.groups.values() if g.members},
                   key=lambda k: (-len(k[0]), k))
    by_rank = {rank: d.by_key() for rank, d in sorted(dumps.items())}  # once per rank, not per group and rank
    for key in keyed:
        for rank, groups in by_rank.items():
            g = groups.get(key)
            if g is None:
                continue
            last = g.last
            rows.append({
                "group": group_label(g, world), "rank": rank,
                "last op": f"{op_text(last)} #{last.seq}" + (" (p2p)" if last.p2p else "") if last else "-",
                "sizes": str(last.sizes) if last else "-", "dtypes": ",".join(last.dtypes or []) if last else "-",
                "state": last.state if last else "-",
                "enqueued/completed": f"{_n(g.enqueued)}/{_n(g.completed)}",
                "called at": last.frames[0] if last and last.frames else "-",
            })
    return rows


def _n(value: int | None) -> str:
    return "?" if value is None else str(value)


def _dump_wording(findings: list[Finding], dumps: dict[int, RankDump], world: int) -> None:
    """Say what the dumps show where the rules speak of live processes (stacks, the store)."""
    for f in findings:
        if f.cause == SilentReason.NO_DUMP.cause:
            f.evidence = (f"{len(dumps)} dump file(s) given, of {format_ranks(sorted(dumps))}; the job has {world} ranks "
                          "by the dumps' group members (or --world-size)")


def _read_note(dumps: dict[int, RankDump], notes: list[str]) -> Finding:
    versions = sorted({d.version for d in dumps.values()})
    libs = sorted({d.comm_lib_version for d in dumps.values() if d.comm_lib_version})
    unknown = any(g.completion_unknown for d in dumps.values() for g in d.groups.values())
    how = ("gloo dumps record no completion: each rank's last recorded collective is taken as the one it is in"
           if unknown else "positions from each dump's pg_status (enqueued / started / completed per group)")
    lib = f", communication library {'/'.join(libs)}" if libs else ""
    return Finding(severity="info", issue=f"read flight-recorder dumps of {format_ranks(sorted(dumps))} "
                   f"(dump version {'/'.join(versions)}{lib})", evidence="\n".join([how, *notes]))


def _other_recorder(name: str, raw: Raw, ranks: list[int], world: int) -> list[Finding]:
    """Findings from a second recorder's dumps (gloo beside NCCL): analysed apart, its groups and
    sequence numbers its own; a rank with no dump of it recorded nothing there."""
    whole = {r: raw.get(r, {"version": "2.10", "entries": []}) for r in sorted(set(ranks) | set(raw))}
    dumps, _, _ = rank_dumps(whole, world)
    found = findings_from(attribute(dumps, world), dumps)
    for f in found:
        f.issue = f"{name} recorder: {f.issue}"
    return found


def report_from_dumps(raw: Raw, world_size: int | None = None, others: dict[str, Raw] | None = None) -> Report:
    """A Report (probe 'flight_recorder') from per-rank raw dumps. Raises DumpError.

    The verdict comes from the recorder's semantics (hang/frontier.py: per group the frontier
    and who never entered it, each rank's oldest unfinished op, send/recv paired by sender and
    receiver); the findings name the ranks at the ends of the chains of waits (hang/dumpblame.py).
    `others`: dumps of the same job by another recorder (gloo's beside NCCL's), analysed apart."""
    from distdiag.hang.picture import picture_of_dumps
    from distdiag.hang.views import snapshot_details

    dumps, world, notes = rank_dumps(raw, world_size)
    attribution = attribute(dumps, world)
    findings = findings_from(attribution, dumps)
    for name, extra in sorted((others or {}).items()):
        findings += _other_recorder(name, extra, sorted(dumps), world)
        notes.append(f"{len(extra)} dump(s) by the {name} recorder, analysed apart (its groups and numbers are its own)")
    findings.sort(key=lambda f: f.severity not in ("critical", "error"))
    _dump_wording(findings, dumps, world)
    findings.append(_read_note(dumps, notes))
    snaps: dict[int, dict[str, Any]] = {
        rank: {"phase": "training", "where": "the dumped job", "stack": [], "recent": [],
               "engine": engine_view(d, world), "in_collective": None, "place": where_in_dump(d, world)}
        for rank, d in dumps.items()
    }
    details = snapshot_details(snaps)
    for key in ("stacks", "recent_collectives", "recent_collectives_table",
                "table:collectives per group (torch's flight recorder)"):
        details.pop(key, None)
    details["table:last op per group and rank (flight-recorder dumps)"] = groups_table(dumps, world)
    details["groups"] = {str(r): {group_label(g, world): g.as_dict() for g in d.by_key().values()}
                         for r, d in dumps.items()}
    details["wait_for_graph"] = picture_of_dumps(attribution)  # `hang-report --graph` draws it
    result = ProbeResult.from_findings("flight_recorder", findings, details=details)
    code = EXIT_HANG if any(f.severity == "critical" for f in findings) else EXIT_PASS
    return Report(
        world_size=world, probes=[result], exit_code=code, verdict=verdict_for(code, [result]),
        outcome="hang" if code else "completed", summary=findings[0].issue,
    )
