"""Desyncs: ranks whose collectives stop matching, found three ways.

- `find_desync` / `desync_finding`: from the watchdog's fingerprint histories (op, shape,
  dtype, call site per collective: the wrappers' records, or without wrappers the recorder's
  entries with the call sites torch's stack dump gives, `engine_history`): the first sequence number where a rank departs from the
  majority - a different op or shape (`mismatch`), or a call-site shift by one (`skipped`,
  `extra`: a collective the backend paired silently with the next one).
- `first_divergence`: the coarser per-record comparison of the recent collectives.
- `record_divergence`: from torch's flight-recorder entries (distdiag.hang.recorder): the same
  sequence number on a group with a different op or sizes - it sees the collectives no
  wrapper saw (compiled graphs, C++ callers).
"""

from __future__ import annotations

import bisect
import functools
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from distdiag.hang.recorder import dtype_name
from distdiag.hang.records import CAUSE_DESYNC
from distdiag.hang.views import coll_label, tensor_text
from distdiag.report.model import Finding
from distdiag.report.render import format_ranks

__all__ = [
    "SHAPE_FREE_OPS", "find_desync", "desync_finding", "desync_lines", "first_divergence", "has_history",
    "record_divergence", "record_desync_finding", "departure", "departures", "break_tie", "odd_by_call_site", "engine_history",
]


def _fingerprint(c: dict[str, Any]) -> tuple[Any, ...]:
    return (c["op"], str(c.get("shape")), c.get("dtype"))


def _step_sites(snap: dict[str, Any]) -> list[tuple[Any, list[str]]]:
    """The rank's recorded call sites grouped by training step, in order (the window's first
    step may be cut short by the history's length)."""
    records = _records(snap)
    cur = snap.get("in_collective")
    if cur and not any(c.get("seq") == cur.get("seq") and c.get("group") == cur.get("group") for c in records[-4:]):
        records.append(cur)  # the watchdog's history holds it already; the check's recent does not
    out: list[tuple[Any, list[str]]] = []
    for c in records:
        step = c.get("step")
        if step is None:
            if c.get("source") == "engine":
                continue  # recorded before the first step (setup, or before arming)
            return []
        if not out or out[-1][0] != step:
            out.append((step, []))
        # the op with its line: one line may issue several ops (FSDP's all-gathers and
        # reduce-scatters all come from the model's call)
        out[-1][1].append(f"{c.get('op')} at {c.get('call_site')}")
    return out


def departure(snap: dict[str, Any], *, loop: bool = True) -> str | None:
    """How a rank's latest steps depart from its own history, or None.

    Every step of a training loop issues the same collectives from the same lines. The rank
    whose current step (the collective it waits in included) issued another line at some
    position than its earlier steps did - or that left its training loop - is the one that
    changed course; with two ranks there is no majority to say it, but each rank's past does.
    `loop=False`: only the steps count, not where the program is now (a rank ended from outside).
    """
    if loop and snap.get("in_loop") is False:
        return f"it left its training loop ({snap.get('loop') or '?'})"
    steps = _step_sites(snap)[1:]
    if len(steps) < 2:
        return None
    counts = Counter(tuple(sites) for _, sites in steps[:-1])
    pattern, seen = counts.most_common(1)[0]
    # one earlier step in view is enough only when it is all there is (a long step, FSDP's
    # dozens of collectives, fills the recorder's tail): with more, the pattern must repeat
    if seen < 2 and len(steps) > 2:
        return None
    for n, (step, sites) in enumerate(steps):
        last = n == len(steps) - 1
        if tuple(sites) == pattern or (last and tuple(sites) == pattern[: len(sites)]):
            continue
        i = next((i for i, (x, y) in enumerate(zip(sites, pattern, strict=False)) if x != y), min(len(sites), len(pattern)))
        mine = sites[i] if i < len(sites) else "(nothing: the step ended)"
        usual = pattern[i] if i < len(pattern) else "(nothing: the step ended there)"
        return f"in step {step} its collective {i + 1} of the step came from {mine}; in its earlier steps from {usual}"
    return None


def departures(snaps: dict[int, dict[str, Any]], ranks: list[int]) -> dict[int, str]:
    """Rank -> how it departs from its own history, for the ranks of `ranks` that do."""
    out = {}
    for r in ranks:
        text = departure(snaps.get(r) or {})
        if text:
            out[r] = text
    return out


def break_tie(classes: list[list[int]], snaps: dict[int, dict[str, Any]]) -> tuple[list[list[int]], dict[int, str]] | None:
    """Two equal sides: the side whose ranks depart from their own history is the odd one, first
    the other (as majority). None when history does not tell them apart."""
    if len(classes) != 2:
        return None
    by_site = odd_by_call_site(classes, snaps)
    if by_site is not None:
        return by_site
    gone = departures(snaps, [r for c in classes for r in c])
    odd = [c for c in classes if any(r in gone for r in c)]
    if len(odd) != 1:
        return None
    return [c for c in classes if c is not odd[0]] + odd, gone


def odd_by_call_site(classes: list[list[int]], snaps: dict[int, dict[str, Any]]) -> tuple[list[list[int]], dict[int, str]] | None:
    """Two equal sides that part at one (group, seq): SPMD code issues every collective from
    lines every rank runs, so a line that one side issues there and the other side never issued
    before, while the other side's line is one the first side issued before, is the first side's
    alone (a rank-dependent branch, or a loop it left early). None when the lines do not say."""
    sides = []
    for ranks in classes:
        rank = ranks[0]
        recs = _histories({rank: snaps.get(rank) or {}})
        sides.append((ranks, {(g, q): c for g, by in recs.items() for q, c in by.get(rank, {}).items()}))
    (a_ranks, a), (b_ranks, b) = sides
    parted = sorted((k for k in set(a) & set(b) if _fingerprint(a[k]) != _fingerprint(b[k]) or
                     a[k].get("call_site") != b[k].get("call_site")), key=lambda k: (k[1], k[0]))
    if not parted:
        return None
    key = parted[0]
    site_a, site_b = a[key].get("call_site"), b[key].get("call_site")
    if not site_a or not site_b or site_a == site_b:
        return None
    # what each side issued before, by its recorded history: on the same group before that
    # position, and on its other groups (sequence numbers are not comparable across groups)
    before_a = {c.get("call_site") for k, c in a.items() if k[0] != key[0] or k[1] < key[1]}
    before_b = {c.get("call_site") for k, c in b.items() if k[0] != key[0] or k[1] < key[1]}
    a_alone = site_a not in before_b and site_b in before_a
    b_alone = site_b not in before_a and site_a in before_b
    if a_alone == b_alone:
        return None
    odd, usual, site, other = (a_ranks, b_ranks, site_a, site_b) if a_alone else (b_ranks, a_ranks, site_b, site_a)
    why = (f"at {key[0]} #{key[1]} it issued a collective from {site}, a line not in its peers' recorded "
           f"history, while their {other} is a line in its own")
    return [usual, odd], {r: why for r in odd}


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


SHAPE_FREE_OPS = frozenset({
    "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "all_gather_object",
    "broadcast_object_list", "gather_object", "scatter_object_list", "gather", "scatter",
})
"""Ops whose shapes may differ between ranks legitimately (uneven splits, root-only lists)."""
_SHIFT_CHECK = 4
"""How many following collectives must confirm a shift before it is called a skip/extra."""


@functools.lru_cache(maxsize=4096)
def _shape_free(op: str) -> bool:
    return op.split("(", 1)[0].rsplit(":", 1)[-1] in SHAPE_FREE_OPS


def _pair_key(c: dict[str, Any]) -> tuple[Any, ...]:
    """What the backend pairs on: the op, and the shape/dtype where they must agree (read for
    every record of every rank: the op's reading is cached, the shape's text made once each)."""
    op = c["op"]
    if type(op) is not str:
        op = str(op)
    if _shape_free(op):
        return (op,)
    shape = c.get("shape")
    return (op, shape if type(shape) is str else str(shape), c.get("dtype"))


def _full_key(c: dict[str, Any]) -> tuple[Any, ...]:
    return (*_pair_key(c), c.get("call_site"))


def engine_history(snap: dict[str, Any]) -> list[dict[str, Any]]:
    """A rank's recent collectives as the wrappers would record them, from its flight-recorder
    entries that carry a call site (distdiag.hang.recorder reads them from torch's stack dump
    at snapshot time): the history of a rank watched without wrappers. Sequence numbers are
    torch's own, the same counting on every rank; a collective's step is the last step the
    rank began before the recorder stamped it (`step_walls`: wall-clock ns, step)."""
    walls = [w for w in snap.get("step_walls") or [] if isinstance(w, list | tuple) and len(w) == 2]
    stamps = [int(w[0]) for w in walls]
    out = []
    for e in (snap.get("engine") or {}).get("entries") or []:
        if e.get("call_site") and not e.get("p2p"):
            sizes = e.get("sizes")
            shape = sizes[0] if isinstance(sizes, list) and sizes and isinstance(sizes[0], list) else None
            dtypes = e.get("dtypes")
            dtype = dtype_name(dtypes[0]) if isinstance(dtypes, list) and dtypes else "?"
            out.append({"op": e.get("op"), "group": e.get("group"), "seq": e.get("seq"), "shape": shape,
                        "dtype": dtype, "call_site": e["call_site"], "step": _step_at(walls, stamps, e), "source": "engine"})
    return out


def _step_at(walls: list[Any], stamps: list[int], entry: dict[str, Any]) -> Any:
    i = bisect.bisect_right(stamps, int(entry.get("created_ns") or 0))
    return walls[i - 1][1] if i else None


def _records(snap: dict[str, Any]) -> list[dict[str, Any]]:
    """The wrappers' history where they ran, else the recorder's entries with call sites."""
    return list(snap.get("history") or snap.get("recent") or engine_history(snap))


def has_history(snaps: dict[int, dict[str, Any]]) -> bool:
    return any(s.get("history") or engine_history(s) for s in snaps.values())


def _histories(snaps: dict[int, dict[str, Any]]) -> dict[str, dict[int, dict[int, dict[str, Any]]]]:
    by_group: dict[str, dict[int, dict[int, dict[str, Any]]]] = defaultdict(lambda: defaultdict(dict))
    for rank, snap in snaps.items():
        records = _records(snap)
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
        why: dict[int, str] = {}
        broken = break_tie(classes, snaps) if tie else None
        if broken is not None:
            classes, why = broken
            tie = False
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
            "ref": ref, "why": {r: why[r] for r in odd if r in why},
        }
        if best is None or seq < best["seq"]:
            best = located
    return best


def _rec_text(c: dict[str, Any] | None) -> str:
    if c is None:
        return "(nothing recorded)"
    step = f" in step {c['step']}" if c.get("step") is not None else ""
    return f"{coll_label(c)}{step} at {c.get('call_site', '?')}"


def desync_lines(d: dict[str, Any]) -> list[str]:
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
            f"desync on group {group} at collective #{seq}{at}: {who} issued {mine.get('op')}"
            f"{tensor_text(mine)} at {mine.get('call_site', '?')} where {others} issued "
            f"{theirs.get('op')}{tensor_text(theirs)} at {theirs.get('call_site', '?')}"
        )
    if d["tie"]:
        issue += " (no majority: either side may be the odd one)"
    elif d.get("why"):
        issue += "; " + "; ".join(f"rank {r} departs from its own history: {t}" for r, t in sorted(d["why"].items()))
    return Finding(
        severity="critical",
        issue=issue,
        evidence="\n".join([f"first divergence at {group} #{seq}:", *desync_lines(d)]),
        ranks=sorted(set(odd) | (set(d["majority"]) if d["tie"] else set())),
        fix=(
            "every rank must issue the same collectives in the same order: look for a rank-dependent "
            "branch, an early return/continue or an extra call around the call sites shown"
        ),
        confidence=0.55 if d["tie"] else 0.9,
        cause=CAUSE_DESYNC,
    )


# -- desync from torch's flight-recorder entries (distdiag.hang.recorder) ---------------------------


def _record_key(e: dict[str, Any], text: Callable[[Any], str] = str) -> tuple[Any, ...]:
    op = str(e.get("op"))
    if op in SHAPE_FREE_OPS:
        return (op,)
    return (op, text(e.get("sizes")), text(e.get("dtypes")))


def _texts() -> Callable[[Any], str]:
    """str() of a value, once per object: ranks' entries often share their sizes and dtypes
    lists (the writer's gather keeps one object per distinct value: runtime/nodes.py), and 16k
    ranks' recorder tails are ~230k entries. The objects are kept with their text (an id is
    only unique while its object lives)."""
    seen: dict[int, tuple[Any, str]] = {}

    def text(v: Any) -> str:
        got = seen.get(id(v))
        if got is None:
            got = seen[id(v)] = (v, str(v))
        return got[1]

    return text


def _record_text(e: dict[str, Any]) -> str:
    return f"{e.get('op')} sizes {e.get('sizes')} dtypes {e.get('dtypes')}"


def record_divergence(snaps: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The first (group, seq) where ranks' recorder entries name a different op or sizes.

    Only sequence numbers that at least two ranks recorded are compared, so ranks whose
    recorder tails cover different stretches are not called desynced.
    """
    by_key: dict[tuple[str, int], dict[int, dict[str, Any]]] = defaultdict(dict)
    text = _texts()
    for rank, snap in snaps.items():
        engine = snap.get("engine") or {}
        for e in engine.get("entries") or []:
            if not e.get("p2p") and int(e.get("seq") or 0) > 0:
                by_key[(str(e.get("group")), int(e["seq"]))][rank] = e
    for (group, seq), by_rank in sorted(by_key.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if len(by_rank) < 2:
            continue
        variants: dict[tuple[Any, ...], list[int]] = defaultdict(list)
        for rank, e in sorted(by_rank.items()):
            variants[_record_key(e, text)].append(rank)
        if len(variants) > 1:
            ordered = sorted(variants.values(), key=lambda rs: (-len(rs), rs[0]))
            tie = len(ordered[0]) == len(ordered[1])
            broken = break_tie(ordered, snaps) if tie else None
            why: dict[int, str] = {}
            if broken is not None:
                (ordered, why), tie = broken, False
            return {"group": group, "seq": seq, "classes": ordered, "by_rank": by_rank, "tie": tie, "why": why}
    return None


def record_desync_finding(d: dict[str, Any], severity: str = "critical") -> Finding:
    """A finding naming the ranks whose recorded collective differs at the first divergence."""
    classes, by_rank = d["classes"], d["by_rank"]
    majority = classes[0]
    odd = sorted(r for c in (classes if d["tie"] else classes[1:]) for r in c)
    lines = [f"  {format_ranks(c)}: {_record_text(by_rank[c[0]])}" for c in classes]
    who = "no majority: either side may be the odd one" if d["tie"] else f"{format_ranks(odd)} differ from {format_ranks(majority)}"
    return Finding(
        severity=severity,
        issue=(
            f"desync on group {d['group']} at collective #{d['seq']} (torch's flight recorder): the ranks recorded "
            f"different collectives there ({who}; {format_ranks(majority)}: {by_rank[majority[0]].get('op')}, "
            f"{format_ranks(odd if not d['tie'] else classes[1])}: {by_rank[(odd if not d['tie'] else classes[1])[0]].get('op')})"
        ),
        evidence="\n".join([f"recorded as collective #{d['seq']} on {d['group']}:", *lines,
                            *(f"rank {r} departs from its own history: {t}" for r, t in sorted(d.get("why", {}).items()))]),
        ranks=odd,
        fix=(
            "every rank must issue the same collectives in the same order and with the same sizes: look for a "
            "rank-dependent branch or data-dependent shapes (this includes collectives torch issues for you: DDP "
            "buckets, FSDP all-gathers, compiled graphs)"
        ),
        confidence=0.5 if d["tie"] else 0.85,
        cause=CAUSE_DESYNC,
    )
