"""The desync rules over every rank's view (distdiag.hang.rules runs them in its order).

  desync_in_flight    - ranks inside different collectives at the same sequence number;
  desync_in_records   - torch's recorder entries differ at the same sequence number;
  desync_in_histories - the watchdog's fingerprint histories part (skip, extra, mismatch).
With two ranks there is no majority: the rank whose step departs from its own history is the
odd one (distdiag.hang.desync.break_tie). Ranks another rule explained are left alone.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from distdiag.hang.desync import (
    break_tie,
    desync_finding,
    desync_lines,
    find_desync,
    first_divergence,
    has_history,
    record_desync_finding,
    record_divergence,
)
from distdiag.hang.records import CAUSE_DESYNC
from distdiag.hang.views import wait_text, with_user_site
from distdiag.report.model import Finding
from distdiag.report.render import format_ranks

__all__ = ["desync_in_flight", "desync_in_records", "desync_in_histories", "a_snaps"]

Analysis = Any
"""distdiag.hang.rules.Analysis (rules.py imports this module, so not imported back here)."""


def _located(a: Analysis) -> dict[str, Any] | None:
    """find_desync over the histories, once per analysis (two rules read it; it reads every
    rank's history)."""
    if not hasattr(a, "_desync_located"):
        snaps = a_snaps(a)
        a._desync_located = find_desync(snaps) if has_history(snaps) else None
    return a._desync_located


def desync_in_flight(a: Analysis) -> None:
    located = _located(a)
    for group, waits in a.waiters().items():
        if group == "p2p":
            continue  # send/recv pair by peer, not by a sequence number shared by a group
        by_seq: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
        for rank, w in waits.items():
            by_seq[int(w["seq"])][rank] = w
        for _seq, same in sorted(by_seq.items()):
            if set(same) <= a.explained:
                continue  # e.g. a short rank's barrier beside the others' next step: uneven data, named
            keys: dict[tuple[Any, ...], list[int]] = defaultdict(list)
            for rank, w in same.items():
                keys[tuple(w.get("key") or (w["op"], str(w.get("shape")), w.get("dtype")))].append(rank)
            if len(keys) < 2:
                continue
            variants = sorted(keys, key=lambda k: (-len(keys[k]), keys[k][0]))
            tie = len(keys[variants[1]]) == len(keys[variants[0]])
            broken = break_tie([keys[k] for k in variants], a_snaps(a)) if tie else None
            why: dict[int, str] = {}
            if broken is not None:
                order, why = broken
                variants = [next(k for k in variants if keys[k] is c) for c in order]
                tie = False
            odd = sorted(r for k in (variants if tie else variants[1:]) for r in keys[k])
            lines = [f"{format_ranks(sorted(keys[k]))}: {wait_text(same[keys[k][0]])} at {same[keys[k][0]].get('call_site', '?')}" for k in variants]
            if located is not None:
                lines.append(f"first divergence at {located['group']} #{located['seq']}:")
                lines += desync_lines(located)
            else:
                diverged = first_divergence(a_snaps(a))
                if diverged is not None:
                    dgroup, dseq, by_rank = diverged
                    lines.append(f"first divergence at {dgroup} #{dseq}:")
                    lines += [f"  rank {r}: {c['op']} at {c.get('call_site', '?')}" for r, c in sorted(by_rank.items())]
            lines += [f"rank {r} departs from its own history: {t}" for r, t in sorted(why.items()) if r in odd]
            who = "no majority: the ranks disagree" if tie else f"odd ones: {format_ranks(odd)}"
            if why and not tie:
                who += " (" + "; ".join(f"rank {r} departs from its own history: {t}" for r, t in sorted(why.items()) if r in odd) + ")"
            who += "; " + ", ".join(f"{format_ranks(sorted(keys[k]))} in {same[keys[k][0]]['op']}" for k in variants)
            consequence = bool(a.causes & set(same))
            if not tie and _told(a, odd, lines[:len(variants)]):
                continue
            a.findings.append(
                Finding(
                    severity="error" if consequence else "critical",
                    issue=(f"desync on group {group}: ranks are inside different collectives at the same sequence number ({who})"
                           + (" - a consequence of the exception above" if consequence else "")),
                    evidence="\n".join(lines),
                    ranks=odd,
                    fix="the ranks issue collectives in a different order or with different shapes: align the code paths",
                    confidence=0.5 if tie else 0.85,
                    cause=CAUSE_DESYNC,
                )
            )
            a.desync_reported = a.desync_reported or located is not None
            a.explained.update(odd)


def _told(a: Analysis, odd: list[int], now: list[str]) -> bool:
    """A desync finding for exactly these ranks was made already (desync_in_histories runs first,
    with both call sites): where each rank waits now (`now`) goes to its evidence, not into a
    second finding telling the same. False when there is none."""
    told = next((f for f in a.findings if f.cause == CAUSE_DESYNC and f.severity == "critical"
                 and sorted(f.ranks) == odd), None)
    if told is None:
        return False
    told.evidence += "\nwhere the ranks wait now:\n" + "\n".join(now)
    a.explained.update(odd)
    return True


def a_snaps(a: Analysis) -> dict[int, dict[str, Any]]:
    return {r: v.snap for r, v in a.views.items()}


def desync_in_records(a: Analysis) -> None:
    if any(f.cause == CAUSE_DESYNC for f in a.findings):
        return
    d = a.divergence() if hasattr(a, "divergence") else record_divergence(a_snaps(a))
    if d is None or set(d["by_rank"]) <= a.explained:
        return  # none, or the ranks' own findings explain it (uneven data)
    severity = "critical" if not any(f.severity == "critical" for f in a.findings) else "error"
    a.findings.append(record_desync_finding(d, severity))
    a.desync_reported = True


def desync_in_histories(a: Analysis) -> None:
    if a.desync_reported or not a.waiters():
        return
    located = _located(a)
    if located is not None and not set(located["odd"]) <= a.explained:
        a.findings.append(desync_finding(_with_user_sites(a, located)))
        a.desync_reported = True


def _with_user_sites(a: Analysis, d: dict[str, Any]) -> dict[str, Any]:
    """The divergence with each call site inside a library (Lightning's _sync_ddp) followed by the
    job's line that led there, where the rank is inside that call now (its stack holds the site,
as 'file:line in func' or with the line's source after ': ')."""
    out = dict(d)
    for key in ("records", "next"):
        recs = dict(d.get(key) or {})
        for r, c in recs.items():
            view = a.views.get(r)
            site = (c or {}).get("call_site")
            stack = (view.snap.get("stack") or []) if view is not None else []
            if site and any(type(x) is str and (x == site or x.startswith(f"{site}: ")) for x in stack):
                recs[r] = {**c, "call_site": with_user_site(str(site), stack)}
        out[key] = recs
    return out
