"""Process groups created in another order, or by their members only.

torch names a group made by `new_group` from a per-process counter (`"1"`, `"2"`, ...) unless
a hashed name is asked for (`use_local_synchronization=True`, `split_group`), and the backend
meets its peers in the store under that name. So every rank must create every numbered group,
member or not, in one order. Each rank's watchdog keeps the numbered names it made, with their
members (distdiag.watchdog.groupnames); where ranks bind one name to different members, their
backends met the wrong peers: the ranks then hang in the group's creation (gloo connects at
once) or in a collective on it (NCCL connects at its first one; gloo may have paired ranks of
two groups), and which collective they wait in says nothing of why. A conflict that can explain
the hang leads and explains every wait: a rank is inside group creation, or waits in a collective
on a group some rank bound at the conflicting number or later (or on one whose members are not
known). One that cannot (every wait is on groups made before it, or on the default group) is
still a bug, but not this hang's cause: it is reported as a warning beside the other rules'
verdict (NCCL connects a group at its first collective, so a conflicting group never used yet has
met no peer).

Which ranks are at fault is told by the evidence, not by the count alone:
- skipped: ranks S bound name p to their next group, while ranks T created at p a group S are
  not members of, then S's group after it: S skipped a group they are not members of ("created
  by its members only"), however many they are;
- otherwise the ranks that bound p as most ranks did are right, the others at fault; with the
  two sides equal nothing tells them apart: both are named, at a lower confidence, with what
  would decide.
"""

from __future__ import annotations

from typing import Any

from distdiag.hang.groupid import parse_label
from distdiag.hang.members import decode_members
from distdiag.hang.records import CAUSE_DESYNC
from distdiag.report.model import Finding
from distdiag.report.render import format_ranks

__all__ = ["group_creation"]

_CREATING = (" in new_group", " in _new_group_with_tag", " in _new_process_group_helper", " in new_subgroups",
             " in split_group")

_FIX_ORDER = ("create process groups in one order on every rank (the same loop over the same, sorted list of "
              "groups), members or not: torch numbers groups per process, and a rank that makes them in another "
              "order binds a number to other members than its peers")
_FIX_SKIP = ("call dist.new_group(ranks) on every rank for every group, members or not (a non-member gets "
             "GroupMember.NON_GROUP_MEMBER back), or pass use_local_synchronization=True so that only the members "
             "call it (the group is then named from its members, not from a per-process count)")


def _names(snap: dict[str, Any]) -> tuple[dict[int, str], bool, dict[int, str]]:
    """name -> members of the numbered groups a rank made, whether its log has every call
    (member or not) rather than torch's registry of its own groups only, and name -> the line
    that made it (where the log kept one)."""
    g = snap.get("groups_created")
    if not isinstance(g, dict):
        return {}, False, {}
    out: dict[int, str] = {}
    sites: dict[int, str] = {}
    for row in g.get("names") or []:
        if isinstance(row, (list, tuple)) and len(row) in (2, 3) and str(row[0]).isdigit():
            out[int(row[0])] = str(row[1])
            if len(row) == 3 and row[2] and row[2] != "?":
                sites[int(row[0])] = str(row[2])
    return out, g.get("from") == "calls", sites


def _members(spec: str) -> set[int]:
    try:
        return set(decode_members(spec)) if spec != "*" else set()
    except ValueError:
        return set()


def _skipped(side: list[int], other: list[int], p: int, logs: dict[int, dict[int, str]],
             full: dict[int, bool]) -> str | None:
    """`side` skipped groups it is not a member of: from p on, another rank's creations become
    `side`'s by leaving out only groups without `side`'s ranks (at least one, never made by
    `side` later), and at least one of `side`'s groups is then matched."""
    mine = set(side)
    ours = max(side, key=lambda r: len(logs[r]))
    s_seq = [logs[ours][q] for q in sorted(logs[ours]) if q >= p]
    for t in other:
        if not full.get(t):
            continue
        t_seq = [logs[t][q] for q in sorted(logs[t]) if q >= p]
        left_out: list[str] = []
        i = 0
        for spec in t_seq:
            if i < len(s_seq) and spec == s_seq[i]:
                i += 1
            elif i < len(s_seq) and not (_members(spec) & mine):
                left_out.append(spec)
            else:
                break
        if i and left_out and not set(left_out) & set(s_seq) and (i == len(s_seq) or len(t_seq) == i + len(left_out)):
            return ", ".join(f"[{_show(m)}]" for m in left_out)
    return None


def _creating(snap: dict[str, Any]) -> bool:
    """Inside torch's group creation now (its main-thread stack)."""
    return any(any(k in line for k in _CREATING) for line in (snap.get("stack") or [])[-12:])


def _show(spec: str) -> str:
    members = sorted(_members(spec))
    return ",".join(map(str, members)) if len(members) <= 16 else f"{format_ranks(members)} ({len(members)} ranks)"


def _first_conflict(logs: dict[int, dict[int, str]]) -> tuple[int, list[tuple[str, list[int]]]] | None:
    """The lowest group number bound to different members, with each binding's ranks (most first)."""
    claims: dict[int, dict[str, list[int]]] = {}
    for r, names in logs.items():
        for p, spec in names.items():
            claims.setdefault(p, {}).setdefault(spec, []).append(r)
    conflicts = sorted(p for p, sides in claims.items() if len(sides) > 1)
    if not conflicts:
        return None
    p = conflicts[0]
    return p, sorted(((spec, sorted(rs)) for spec, rs in claims[p].items()), key=lambda kv: (-len(kv[1]), kv[1]))


def _blame(a: Any, p: int, sides: list[tuple[str, list[int]]], logs: dict[int, dict[int, str]],
           full: dict[int, bool]) -> tuple[list[int], str, float, str]:
    """(culprits, what they did, confidence, fix): the side that left out groups it is not a
    member of; else the ranks outside the largest side; else every side, at 0.5."""
    for spec, side in sides:
        rest = sorted(r for s, rs in sides if s != spec for r in rs)
        gap = _skipped(side, rest, p, logs, full)
        if gap is not None:
            still = [r for r in side if _creating(a.views[r].snap)]
            how = (f"left out {gap}, a group {'it is not a member' if len(side) == 1 else 'they are not members'} of, that "
                   f"{format_ranks(rest)} created as group '{p}'"
                   + (f" ({format_ranks(still)} still making groups: it may come later, in another order)" if still else ""))
            return side, how, 0.85, f"{_FIX_SKIP}; or, if the group is meant for every rank, {_FIX_ORDER}"
    if len(sides[0][1]) > len(sides[1][1]):
        culprits = sorted(r for _, rs in sides[1:] for r in rs)
        how = f"created {'its' if len(culprits) == 1 else 'their'} groups in another order"
        return culprits, how, 0.8, _FIX_ORDER
    culprits = sorted(r for _, rs in sides for r in rs)
    how = ("bound one group number to different members, as many ranks on each side; which side is wrong is not "
           "told by the ranks: the side whose new_group calls differ from the order your program means (its "
           "config or loop) is at fault")
    return culprits, how, 0.5, _FIX_ORDER


def _explains_hang(a: Any, p: int, logs: dict[int, dict[int, str]]) -> bool:
    """Whether the conflict at group number p can be why the ranks wait (see the module's text)."""
    if any(_creating(v.snap) for v in a.views.values()):
        return True
    bound = {frozenset(_members(spec)) for names in logs.values() for q, spec in names.items() if q >= p}
    waits = [w for v in a.views.values() for w in v.waits]
    for w in waits:
        members = parse_label(str(w.get("group", ""))).ranks(a.world)
        if members is None or frozenset(members) in bound:
            return True
    return not waits


def group_creation(a: Any) -> None:
    """Ranks that bound one group number to different members (see the module's text)."""
    logs: dict[int, dict[int, str]] = {}
    full: dict[int, bool] = {}
    sites: dict[int, dict[int, str]] = {}
    for r, v in a.views.items():
        names, whole, made_at = _names(v.snap)
        if names:
            logs[r], full[r], sites[r] = names, whole, made_at
    found = _first_conflict(logs) if len(logs) > 1 else None
    if found is None:
        return
    p, sides = found
    culprits, how, confidence, fix = _blame(a, p, sides, logs, full)
    if set(culprits) & a.explained:
        return
    relevant = _explains_hang(a, p, logs)
    at = {spec: sorted({sites[r][p] for r in rs if p in sites.get(r, {})}) for spec, rs in sides}
    lines = [f"{format_ranks(rs)}: group '{p}' = [{_show(spec)}]" + (f", made at {'; '.join(at[spec][:2])}" if at[spec] else "")
             for spec, rs in sides]
    for r in sorted(logs)[:8]:
        made = ", ".join(f"'{q}' [{_show(logs[r][q])}]" for q in sorted(logs[r]) if q >= p)
        lines.append(f"rank {r} made, from '{p}' on: {made or '-'}")
    if not relevant:
        lines.insert(0, "no rank waits on a group made at or after this number, and none is making a group: "
                        "this conflict is not why the ranks wait now (the other findings say why)")
    a.findings.append(Finding(
        severity="critical" if relevant else "warning",
        issue=(f"{format_ranks(culprits)} {how}: torch numbers groups per process, and group '{p}' is "
               f"[{_show(sides[0][0])}] on {format_ranks(sides[0][1])} but "
               + "; ".join(f"[{_show(s)}] on {format_ranks(rs)}" for s, rs in sides[1:])
               + ": their backends met the wrong peers"
               + (" (" + "; ".join(f"{format_ranks(rs)} made it at {at[spec][0]}" for spec, rs in sides if at[spec]) + ")"
                  if confidence <= 0.5 and any(at.values()) else "")),
        evidence="\n".join(["the numbered process groups each rank created (name: members):", *lines]),
        ranks=culprits,
        fix=fix,
        confidence=confidence if relevant else min(confidence, 0.6),
        cause=CAUSE_DESYNC,
    ))
    if not relevant:
        return
    a.explained.update(culprits)
    a.causes.update(culprits)
    a.explained.update(a.views)  # the others wait on the groups that met the wrong peers
