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
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from distdiag.render import format_ranks
from distdiag.report import Finding

__all__ = ["analyze_hang", "rank_state", "state_rows"]

_DISTDIAG_FRAMES = ("/distdiag/check.py", "/distdiag/sentinel.py", "/distdiag/tracker.py")


def _where(stack: list[str]) -> str:
    """The innermost frame of the stack that is not distdiag's own runner."""
    for line in reversed(stack):
        path = line.split(":", 1)[0]
        if not path.endswith(_DISTDIAG_FRAMES) and "/threading.py" not in path:
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
) -> list[Finding]:
    """Findings for a run that stopped. `what` names the step (e.g. "probe 'collectives'")."""
    findings: list[Finding] = []
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
        findings.append(
            Finding(
                severity="critical" if stranded else "error",
                issue=f"{what} raised on rank {rank}: {err.get('type')}: {err.get('message')}{left}",
                evidence=err.get("traceback", ""),
                ranks=[rank],
                fix="the exception is the cause; the ranks waiting for this rank are its consequence",
                confidence=0.9,
            )
        )
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
                diverged = first_divergence(live)
                if diverged is not None:
                    dgroup, dseq, by_rank = diverged
                    lines.append(f"first divergence at {dgroup} #{dseq}:")
                    lines += [f"  rank {r}: {c['op']} at {c.get('call_site', '?')}" for r, c in sorted(by_rank.items())]
                who = "no majority: the ranks disagree" if tie else f"odd ones: {format_ranks(odd)}"
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
    return findings
