"""Why a run stopped making progress, from each rank's last snapshot.

Input: one snapshot per rank that could still answer (phase, collective it is inside, its
main-thread stack) and what is known of the ranks that could not (process gone, stopped,
silent). Output: findings that name the culprit ranks, where they are, and the fix.
The rules, in order of precedence:
  1. a rank that is gone or stopped is the cause;
  2. a rank whose probe raised while others wait in a collective left them stranded;
  3. ranks outside any collective while others wait in one never entered it;
  4. ranks that finished the step while others wait issued fewer collectives;
  5. ranks inside different collectives (op, shape) at the same sequence number: a desync;
  6. every rank inside the same collective: a stall below the program (network, fabric);
  7. nobody inside a collective: the step itself is slower than the deadline.
When snapshots carry a fingerprint `history` (the watchdog's), `find_desync` also locates the
first sequence number where a rank's collectives stop matching the majority's - a different
op or shape, or a call-site shift by one (a skipped or an extra collective that gloo/NCCL
paired silently with the next one) - and `desync_finding` names the rank, step and sites.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from distdiag.render import format_ranks
from distdiag.report import Finding

__all__ = [
    "analyze_hang", "rank_state", "state_rows", "find_desync", "desync_finding", "SHAPE_FREE_OPS",
    "snapshot_details", "ensure_critical",
]

_DISTDIAG_FRAMES = ("/distdiag/check.py", "/distdiag/sentinel.py", "/distdiag/tracker.py", "/distdiag/watch.py", "/runpy.py")
_DISTDIAG_DIRS = ("/distdiag/watchdog/",)


def _where(stack: list[str]) -> str:
    """The innermost frame of the stack that is not distdiag's own runner."""
    for line in reversed(stack):
        path = line.split(":", 1)[0]
        if not path.endswith(_DISTDIAG_FRAMES) and "/threading.py" not in path and not any(d in path for d in _DISTDIAG_DIRS):
            return line
    return stack[-1] if stack else "?"


def rank_state(snap: dict[str, Any]) -> str:
    if snap.get("in_collective"):
        return "collective"
    phase = snap.get("phase")
    if phase == "barrier":
        return "finished"
    if phase == "final":
        return "final"
    if phase == "setup":
        return "setup"
    return "computing"


def _coll_label(c: dict[str, Any]) -> str:
    shape = "x".join(str(s) for s in c.get("shape") or []) or "-"
    return f"{c['op']} #{c['seq']} on {c['group']} ({c.get('dtype', '?')}[{shape}])"


def state_rows(snaps: dict[int, dict[str, Any]], lost: dict[int, str], world: int) -> list[dict[str, Any]]:
    rows = []
    for rank in range(world):
        if rank in snaps:
            s = snaps[rank]
            state = rank_state(s)
            if state == "collective":
                c = s["in_collective"]
                what = f"in {_coll_label(c)} for {c.get('for_s', 0):.1f}s, called at {c.get('call_site', '?')}"
            elif state == "finished":
                what = f"finished '{s.get('probe')}' after {s.get('collectives_in_probe', 0)} collectives, waiting for the others"
            else:
                what = f"{state} in '{s.get('probe') or s.get('phase')}' for {s.get('phase_for_s', 0):.1f}s at {_where(s.get('stack', []))}"
            rows.append({"rank": rank, "host": s.get("host", "?"), "pid": s.get("pid", "?"), "state": state, "where": what})
        else:
            rows.append({"rank": rank, "host": "?", "pid": "?", "state": "lost", "where": lost.get(rank, "no answer")})
    return rows


def snapshot_details(snaps: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Per-rank stacks and recent collectives for a hang result's details (check and watchdog)."""
    return {
        "stacks": {str(r): s.get("stack", []) for r, s in sorted(snaps.items())},
        "recent_collectives": {str(r): s.get("recent", []) for r, s in sorted(snaps.items())},
    }


def ensure_critical(findings: list[Finding], issue: str, evidence: str, fix: str) -> None:
    """A run that ended early always leads with a critical finding: this one when no analysis named one."""
    if not any(f.severity == "critical" for f in findings):
        findings.append(Finding(severity="critical", issue=issue, evidence=evidence, fix=fix, confidence=0.5))


def _fingerprint(c: dict[str, Any]) -> tuple[Any, ...]:
    return (c["op"], str(c.get("shape")), c.get("dtype"))


def first_divergence(snaps: dict[int, dict[str, Any]]) -> tuple[str, int, dict[int, dict[str, Any]]] | None:
    """The first (group, seq) at which ranks' recorded collectives differ, from their histories."""
    history: dict[tuple[str, int], dict[int, dict[str, Any]]] = defaultdict(dict)
    for rank, snap in snaps.items():
        for c in list(snap.get("recent", [])) + ([snap["in_collective"]] if snap.get("in_collective") else []):
            history[(c["group"], int(c["seq"]))][rank] = c
    for (group, seq), by_rank in sorted(history.items(), key=lambda kv: kv[0][1]):
        if len(by_rank) > 1 and len({_fingerprint(c) for c in by_rank.values()}) > 1:
            return group, seq, by_rank
    return None


def _stack_text(snap: dict[str, Any], limit: int = 8) -> str:
    return "\n".join(snap.get("stack", [])[-limit:])


def analyze_hang(
    snaps: dict[int, dict[str, Any]],
    lost: dict[int, str],
    errors: dict[int, dict[str, Any]],
    world: int,
    *,
    what: str,
    timeout_s: float,
    raise_ends_run: bool = False,
) -> list[Finding]:
    """Findings for a run that stopped. `what` names the step (e.g. "probe 'collectives'").

    `raise_ends_run`: the run ended because of this step, so when nothing else is critical a
    rank's exception is the cause (e.g. a failed setup) and leads as critical.
    """
    findings: list[Finding] = []
    raised: list[Finding] = []
    if lost:
        by_reason: dict[str, list[int]] = defaultdict(list)
        for rank, reason in sorted(lost.items()):
            by_reason[reason].append(rank)
        for reason, ranks in by_reason.items():
            findings.append(
                Finding(
                    severity="critical",
                    issue=f"{format_ranks(ranks)} lost during {what}: {reason}",
                    evidence=f"no snapshot from {format_ranks(ranks)} through the store; the others kept answering",
                    ranks=ranks,
                    fix=(
                        "look for the process's end: the kernel log (dmesg: OOM killer, segfault), "
                        "torchrun's per-worker exit code, the node's health; a stopped process "
                        "(SIGSTOP, debugger) must be continued or killed"
                    ),
                    confidence=0.95,
                )
            )
    live = {r: s for r, s in snaps.items() if r not in lost}
    states = {r: rank_state(s) for r, s in live.items()}
    in_coll = {r: live[r]["in_collective"] for r, st in states.items() if st == "collective"}
    stranded = sorted(in_coll)
    for rank, err in sorted(errors.items()):
        left = ""
        if stranded:
            left = f"; {format_ranks(stranded)} were left waiting in {_coll_label(in_coll[stranded[0]])} that it never entered"
        raised.append(
            Finding(
                severity="critical" if stranded else "error",
                issue=f"{what} raised on rank {rank}: {err.get('type')}: {err.get('message')}{left}",
                evidence=err.get("traceback", ""),
                ranks=[rank],
                fix="the exception is the cause; the ranks waiting for this rank are its consequence",
                confidence=0.9,
            )
        )
    findings += raised
    desync_reported = False
    computing = sorted(r for r, st in states.items() if st in ("computing", "setup"))
    finished = sorted(r for r, st in states.items() if st == "finished")
    if in_coll:
        waiting = sorted(in_coll)
        first = in_coll[waiting[0]]
        label = _coll_label(first)
        if computing and not lost:
            for rank in computing:
                snap = live[rank]
                findings.append(
                    Finding(
                        severity="critical",
                        issue=(
                            f"rank {rank} never entered {first['op']} #{first['seq']} on {first['group']} that "
                            f"{format_ranks(waiting)} wait in; it is at {_where(snap.get('stack', []))}"
                        ),
                        evidence=f"rank {rank} main-thread stack (innermost last):\n{_stack_text(snap)}",
                        ranks=[rank],
                        fix=(
                            f"find why rank {rank} is stuck or slow there (a rank-dependent branch, I/O, "
                            "a lock, data loading); every rank must reach the same collectives in the same order"
                        ),
                        confidence=0.9,
                    )
                )
        if finished and not errors and not lost:
            counts = ", ".join(f"rank {r}: {live[r].get('collectives_in_probe', 0)}" for r in finished)
            findings.append(
                Finding(
                    severity="critical",
                    issue=(
                        f"{format_ranks(finished)} finished {what} while {format_ranks(waiting)} wait in {label}: "
                        f"the finished ranks issued fewer collectives (one was skipped)"
                    ),
                    evidence=(
                        f"collectives issued in this step: {counts}; "
                        + ", ".join(f"rank {r}: {live[r].get('collectives_in_probe', 0)}" for r in waiting)
                        + f"; waiting call site: {first.get('call_site', '?')}"
                    ),
                    ranks=finished,
                    fix="look for a rank-dependent branch around this collective; every rank must issue it",
                    confidence=0.8,
                )
            )
        keys: dict[tuple[Any, ...], list[int]] = defaultdict(list)
        for rank, c in in_coll.items():
            keys[(c["group"], c["seq"], *_fingerprint(c))].append(rank)
        by_group: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
        for key in keys:
            by_group[key[0]].append(key)
        # Where histories first part: the same for every group, so found once (and only
        # from the coarser per-record comparison when the full histories locate nothing).
        located = find_desync(live) if _has_history(live) else None
        diverged: Any = None
        for group, variants in by_group.items():
            if len(variants) > 1:
                variants.sort(key=lambda k: -len(keys[k]))
                majority = keys[variants[0]]
                tie = len(keys[variants[1]]) == len(majority)
                odd = sorted(r for k in (variants if tie else variants[1:]) for r in keys[k])
                lines = [
                    f"{format_ranks(sorted(keys[k]))}: {_coll_label(in_coll[keys[k][0]])} at {in_coll[keys[k][0]].get('call_site', '?')}"
                    for k in variants
                ]
                if located is None and diverged is None:
                    diverged = first_divergence(live)
                if located is not None:
                    lines.append(f"first divergence at {located['group']} #{located['seq']}:")
                    lines += _desync_lines(located)
                    desync_reported = True
                if diverged is not None:
                    dgroup, dseq, by_rank = diverged
                    lines.append(f"first divergence at {dgroup} #{dseq}:")
                    lines += [f"  rank {r}: {c['op']} at {c.get('call_site', '?')}" for r, c in sorted(by_rank.items())]
                who = "no majority: the ranks disagree" if tie else f"odd ones: {format_ranks(odd)}"
                who += "; " + ", ".join(f"{format_ranks(sorted(keys[k]))} in {in_coll[keys[k][0]]['op']}" for k in variants)
                findings.append(
                    Finding(
                        severity="critical",
                        issue=f"desync on group {group}: ranks are inside different collectives at the same sequence number ({who})",
                        evidence="\n".join(lines),
                        ranks=odd,
                        fix="the ranks issue collectives in a different order or with different shapes: align the code paths",
                        confidence=0.5 if tie else 0.85,
                    )
                )
        if not computing and not finished and not lost and not errors and len(keys) == 1 and len(in_coll) == world:
            findings.append(
                Finding(
                    severity="critical",
                    issue=f"every rank has been inside {label} for {min(c.get('for_s', 0) for c in in_coll.values()):.1f}s: the collective does not complete",
                    evidence=f"all {world} ranks entered the same collective (same op, sequence number and shape)",
                    ranks=[],
                    fix="a stall below the program: check the network/fabric (NCCL_DEBUG=INFO, link errors), GPU health, and the process group's transport",
                    confidence=0.6,
                )
            )
        if not desync_reported and located is not None:
            findings.append(desync_finding(located))
    elif not lost and not errors:
        slow = sorted(live)
        where = "; ".join(f"rank {r} at {_where(live[r].get('stack', []))}" for r in slow[:4])
        findings.append(
            Finding(
                severity="critical",
                issue=f"{what} did not finish within {timeout_s:g}s and no rank is inside a collective: {where}",
                evidence="\n".join(f"rank {r}:\n{_stack_text(live[r], 4)}" for r in slow[:4]),
                ranks=slow if len(slow) < world else [],
                fix="if the work is just slow, raise the deadline (--timeout-s); otherwise the stacks show where it loops",
                confidence=0.6,
            )
        )
    if raise_ends_run and not any(f.severity == "critical" for f in findings):
        for f in raised:
            f.severity = "critical"
    return findings


# -- desync from fingerprint histories (the watchdog's snapshots) ---------------------------

SHAPE_FREE_OPS = frozenset({
    "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "all_gather_object",
    "broadcast_object_list", "gather_object", "scatter_object_list", "gather", "scatter",
})
"""Ops whose shapes may differ between ranks legitimately (uneven splits, root-only lists)."""
_SHIFT_CHECK = 4
"""How many following collectives must confirm a shift before it is called a skip/extra."""


def _pair_key(c: dict[str, Any]) -> tuple[Any, ...]:
    """What the backend pairs on: the op, and the shape/dtype where they must agree."""
    op = str(c["op"])
    if op.split("(", 1)[0].rsplit(":", 1)[-1] in SHAPE_FREE_OPS:
        return (op,)
    return (op, str(c.get("shape")), c.get("dtype"))


def _full_key(c: dict[str, Any]) -> tuple[Any, ...]:
    return (*_pair_key(c), c.get("call_site"))


def _has_history(snaps: dict[int, dict[str, Any]]) -> bool:
    return any(s.get("history") for s in snaps.values())


def _histories(snaps: dict[int, dict[str, Any]]) -> dict[str, dict[int, dict[int, dict[str, Any]]]]:
    by_group: dict[str, dict[int, dict[int, dict[str, Any]]]] = defaultdict(lambda: defaultdict(dict))
    for rank, snap in snaps.items():
        records = list(snap.get("history") or snap.get("recent") or [])
        if snap.get("in_collective"):
            records.append(snap["in_collective"])
        for c in records:
            if int(c.get("seq", 0)) > 0:
                by_group[str(c["group"])][rank][int(c["seq"])] = c
    return by_group


def _classify(mine: dict[int, dict[str, Any]], ref: dict[int, dict[str, Any]], lo: int, hi: int) -> tuple[int, str] | None:
    """The first seq where `mine` stops matching `ref`, and why: mismatch | skipped | extra."""
    for seq in range(lo, hi + 1):
        a, b = mine.get(seq), ref.get(seq)
        if a is None or b is None or _full_key(a) == _full_key(b):
            continue
        if _pair_key(a) != _pair_key(b):
            return seq, "mismatch"
        ahead = [s for s in range(seq, seq + _SHIFT_CHECK) if s in mine and s + 1 in ref]
        if ahead and all(_full_key(mine[s]) == _full_key(ref[s + 1]) for s in ahead):
            return seq, "skipped"
        behind = [s for s in range(seq, seq + _SHIFT_CHECK) if s + 1 in mine and s in ref]
        if behind and all(_full_key(mine[s + 1]) == _full_key(ref[s]) for s in behind):
            return seq, "extra"
        # Same op and shape from another line, and no shift after it: a legitimate
        # rank-dependent call site (e.g. `if rank == 0: broadcast(...) else: broadcast(...)`).
    return None


def find_desync(snaps: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The earliest point where some rank's collective history departs from the majority's."""
    best: dict[str, Any] | None = None
    for group, ranks in _histories(snaps).items():
        if len(ranks) < 2:
            continue
        lo = max(min(recs) for recs in ranks.values())
        hi = max(max(recs) for recs in ranks.values())
        if lo > hi:
            continue
        sig: dict[tuple[Any, ...], list[int]] = defaultdict(list)
        common_hi = min(max(recs) for recs in ranks.values())
        for rank, recs in sorted(ranks.items()):
            sig[tuple(_full_key(recs[s]) if s in recs else None for s in range(lo, common_hi + 1))].append(rank)
        if len(sig) < 2 and all(max(recs) == hi for recs in ranks.values()):
            continue
        classes = sorted(sig.values(), key=lambda rs: (-len(rs), rs[0]))
        tie = len(classes) > 1 and len(classes[0]) == len(classes[1])
        majority = classes[0]
        ref = majority[0]
        hits: list[tuple[int, str, int]] = []
        for rank in sorted(ranks):
            if rank in majority:
                continue
            found = _classify(ranks[rank], ranks[ref], lo, hi)
            if found is not None:
                hits.append((found[0], found[1], rank))
        if not hits:
            continue
        seq = min(h[0] for h in hits)
        odd = sorted(h[2] for h in hits if h[0] == seq)
        kind = next(h[1] for h in hits if h[0] == seq)
        located = {
            "group": group, "seq": seq, "kind": kind, "odd": odd, "majority": majority, "tie": tie,
            "records": {r: ranks[r].get(seq) for r in odd + [ref]},
            "next": {r: ranks[r].get(seq + 1) for r in odd + [ref]},
            "ref": ref,
        }
        if best is None or seq < best["seq"]:
            best = located
    return best


def _rec_text(c: dict[str, Any] | None) -> str:
    if c is None:
        return "(nothing recorded)"
    step = f" in step {c['step']}" if c.get("step") is not None else ""
    return f"{_coll_label(c)}{step} at {c.get('call_site', '?')}"


def _desync_lines(d: dict[str, Any]) -> list[str]:
    ref = d["ref"]
    lines = [f"  {format_ranks(d['majority'])}: {_rec_text(d['records'][ref])}"]
    lines += [f"  rank {r}: {_rec_text(d['records'][r])}" for r in d["odd"]]
    lines.append(f"then #{d['seq'] + 1}:")
    lines.append(f"  {format_ranks(d['majority'])}: {_rec_text(d['next'][ref])}")
    lines += [f"  rank {r}: {_rec_text(d['next'][r])}" for r in d["odd"]]
    return lines


def desync_finding(d: dict[str, Any]) -> Finding:
    """A finding naming the odd rank(s), the step, and both call sites of the divergence."""
    ref, odd, seq, group = d["ref"], d["odd"], d["seq"], d["group"]
    theirs, mine = d["records"][ref] or {}, d["records"][odd[0]] or {}
    who = format_ranks(odd)
    others = format_ranks(d["majority"])
    step = mine.get("step", theirs.get("step"))
    at = f" in step {step}" if step is not None else ""
    if d["kind"] == "skipped":
        issue = (
            f"desync on group {group}: {who} skipped collective #{seq}{at} - {others} issued {theirs.get('op')} "
            f"at {theirs.get('call_site', '?')}, {who} went on to {mine.get('op')} at {mine.get('call_site', '?')}, "
            "which the backend paired with it"
        )
    elif d["kind"] == "extra":
        issue = (
            f"desync on group {group}: {who} issued one extra {mine.get('op')} as collective #{seq}{at} at "
            f"{mine.get('call_site', '?')}; {others} issued {theirs.get('op')} at {theirs.get('call_site', '?')} "
            "there, and the backend paired the two silently"
        )
    else:
        issue = (
            f"desync on group {group} at collective #{seq}{at}: {who} issued {mine.get('op')} "
            f"({mine.get('dtype', '?')}{mine.get('shape')}) at {mine.get('call_site', '?')} where {others} issued "
            f"{theirs.get('op')} ({theirs.get('dtype', '?')}{theirs.get('shape')}) at {theirs.get('call_site', '?')}"
        )
    if d["tie"]:
        issue += " (no majority: either side may be the odd one)"
    return Finding(
        severity="critical",
        issue=issue,
        evidence="\n".join([f"first divergence at {group} #{seq}:", *_desync_lines(d)]),
        ranks=sorted(set(odd) | (set(d["majority"]) if d["tie"] else set())),
        fix=(
            "every rank must issue the same collectives in the same order: look for a rank-dependent "
            "branch, an early return/continue or an extra call around the call sites shown"
        ),
        confidence=0.55 if d["tie"] else 0.9,
    )
