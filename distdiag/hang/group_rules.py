"""The rules that read the wait-for graph (distdiag.hang.waitfor): across groups, who is to blame.

  uneven_data - a rank left its training loop with fewer steps while the others wait in the
                next step and it waits in a collective of its own (a barrier, a validation
                sync, `wait_for_everyone()`): uneven data, not a desync (a short rank outside
                any collective - a checkpoint save - is named by `behind`);
  deadlock    - ranks that wait for each other on different groups (a cycle in the graph);
  chain_end   - a rank at the end of chains that `behind` did not name (its waiters are in a
                send/recv with it);
  stranded    - the ranks that only wait on a culprit through others, each with its chain
                (info: they are never culprits).
The graph also keeps `behind` (distdiag.hang.rules) from naming a stranded rank.
"""

from __future__ import annotations

from typing import Any

from distdiag.hang.records import CAUSE_DEADLOCK, CAUSE_DESYNC, CAUSE_UNEVEN, Cause, Silence
from distdiag.hang.shapes import counted_shape_lines, shape_lines
from distdiag.report.model import Finding
from distdiag.report.render import format_ranks

Analysis = Any
"""distdiag.hang.rules.Analysis (rules.py imports this module, so not imported back here)."""

__all__ = [
    "skipped_send", "uneven_data", "data_ran_out", "ran_out_first", "ran_out_finding", "loader_passes", "dead_passes", "pass_when", "pass_ended", "deadlock", "chain_end", "stranded", "UNEVEN_FIX"]

UNEVEN_FIX = (
    "rank {rank} ran out of data (or left the loop early) while the others still train: make every rank run "
    "the same number of steps - DistributedSampler(..., drop_last=True) or an equal number of batches per "
    "rank - or wrap the loop in DDP's Join context manager (torch.distributed.algorithms.Join) for uneven inputs"
)


def loader_passes(v: Any) -> dict[tuple[int, int], dict[str, Any]]:
    """(loader, pass) -> that pass's record, from the rank's DataLoader tap (distdiag.watchdog.dataload).
    Only well-formed records (another version's, or a corrupt value, are left out, never raised on)."""
    return passes_of(v.snap.get("loaders"))


def dead_passes(a: Analysis) -> dict[int, dict[tuple[int, int], dict[str, Any]]]:
    """Lost rank -> its DataLoader passes as it wrote them beside its death note (the last time
    one of its passes ended), for the ranks a same-host peer read a death of."""
    out = {}
    for rank, why in a.lost.items():
        passes = passes_of(getattr(Silence.death_of(why), "loaders", None))
        if passes:
            out[rank] = passes
    return out


def passes_of(raw: Any) -> dict[tuple[int, int], dict[str, Any]]:
    out = {}
    for p in raw if isinstance(raw, list) else []:
        if not isinstance(p, dict) or not all(_is_int(p.get(k)) for k in ("loader", "pass", "drawn")):
            continue
        clean = {k: x for k, x in p.items() if k not in ("len", "last", "at_steps") or _is_int(x)}
        clean["label"] = str(p.get("label", "?"))
        out[(p["loader"], p["pass"])] = clean
    return out


def pass_when(p: dict[str, Any]) -> str:
    """' (16 training steps into the run)': when the pass ended, by the training loop's counter (an
    evaluation pass has no steps of its own; 'at training step 16' read as if it had)."""
    n = p.get("at_steps")
    return f" ({n} training step{'' if n == 1 else 's'} into the run)" if _is_int(n) else ""


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def pass_ended(p: dict[str, Any]) -> bool:
    """The pass reached its end: StopIteration seen, or all of its planned length drawn (a
    trainer that plans its steps from len(loader) stops there without asking for more)."""
    length = p.get("len")
    return bool(p.get("exhausted")) or (isinstance(length, int) and 0 < length <= p["drawn"])


def _longer(p: dict[str, Any], drawn: int) -> bool:
    """The pass holds more than `drawn` batches: drawn already, or planned (its sampler's length)."""
    length = p.get("len")
    return p["drawn"] > drawn or (isinstance(length, int) and length > drawn)


def _current(passes: dict[tuple[int, int], dict[str, Any]], key: tuple[int, int]) -> bool:
    """The rank is still in that pass: it has not asked past its end (StopIteration), and no
    batch was drawn from another pass since (a validation pass left behind by training is not)."""
    p = passes[key]
    last = max((int(q.get("last") or 0) for q in passes.values()), default=0)
    return not p.get("exhausted") and int(p.get("last") or 0) >= last


def ran_out_first(a: Analysis, waiting: bool = True) -> list[tuple[int, dict[str, Any], list[int], int]]:
    """(rank, its pass that ran out, the peers that drew more from the same pass, the most they
    drew), for ranks whose DataLoader ended while a peer's went on: uneven data, seen where it
    happens. Only the ranks that ran out with the fewest batches of that pass lead. `waiting`
    False: a peer need not be waiting now (a rank aborted by the mismatch ended their waits)."""
    passes = {r: loader_passes(v) for r, v in a.views.items()}
    if not waiting:
        # a rank aborted in its pass's end collective is the short one: its passes, from its note
        passes.update(dead_passes(a))
    found: dict[tuple[int, int], list[tuple[int, dict[str, Any], list[int], int]]] = {}
    for r, mine in sorted(passes.items()):
        for key, p in mine.items():
            if not pass_ended(p) or any(k[0] == key[0] and k[1] > key[1] for k in mine):
                continue  # not ended, or the rank went on to its loader's next pass (a step-driven loop)
            more = sorted(o for o, theirs in passes.items() if o != r and key in theirs
                          and theirs[key]["label"] == p["label"] and _longer(theirs[key], p["drawn"]))
            # a peer still in that pass, and one of them waiting: the rank's data ended while the
            # peers' goes on, and they wait (a pass every rank has left, however unevenly, or
            # peers that compute their longer share, is not what the ranks wait on now)
            if (more and any(_current(passes[o], key) for o in more)
                    and (not waiting or any(a.views[o].waiting for o in more))):
                most = max(max(passes[o][key]["drawn"], passes[o][key].get("len") or 0) for o in more)
                found.setdefault(key, []).append((r, p, more, most))
    out = []
    for rows in found.values():
        fewest = min(p["drawn"] for _, p, _, _ in rows)
        out += [row for row in rows if row[1]["drawn"] == fewest]
    return out


def data_ran_out(a: Analysis) -> None:
    """A rank whose DataLoader pass ended after fewer batches than a peer drew from the same
    pass, while its peers wait: it left the epoch (and issues the epoch's end collectives) while
    they issue the next step's. Decided by the loaders alone, whatever the trainer does next."""
    if a.lost:
        return
    rows = [row for row in ran_out_first(a) if row[0] not in a.explained]
    for rank, p, more, most in rows:
        waiting = sorted(o for o in a.views if o != rank and a.views[o].waiting)
        a.findings.append(ran_out_finding(a, rank, p, more, most, waiting))
        a.explained.add(rank)
        a.causes.add(rank)
        # every peer that drew more went on into the next step: where it waits (or sits, inside
        # a collective torch's recorder no longer shows) is a consequence
        a.explained.update(waiting, more)


def ran_out_finding(a: Analysis, rank: int, p: dict[str, Any], more: list[int], most: int, waiting: list[int],
                    then: str = "") -> Finding:
    """The finding for `rank`, whose DataLoader pass `p` ended while `more` drew up to `most`
    batches from theirs; `then`: what followed (evidence), when the rules know more."""
    v = a.views[rank]
    w = v.waits[0] if v.waits else None
    nxt = (f"; it went on to {w['op']} #{w['seq']} on {w['group']} at {w.get('call_site', '?')}" if w
           else f"; it is at {v.record.stack[-1] if v.record.stack else '?'}")
    steps = pass_when(p)
    return Finding(
        severity="critical",
        issue=(f"rank {rank} ran out of data: its DataLoader ({p.get('label', '?')}, pass {p['pass']}) ended "
               f"after {p['drawn']} batch(es){steps} while {format_ranks(more)} {'has' if len(more) == 1 else 'have'} "
               f"up to {most} in the same pass{nxt}"),
        evidence="\n".join(x for x in (
            f"batches drawn from that pass: rank {rank} {p['drawn']} ({'then StopIteration' if p.get('exhausted') else 'all of its length'}); "
            + ", ".join(f"rank {o} {loader_passes(a.views[o])[(p['loader'], p['pass'])]['drawn']}" for o in more),
            then, *shape_lines(a, waiting), f"rank {rank} main-thread stack (innermost last):",
            "\n".join(v.record.stack[-8:])) if x),
        ranks=[rank],
        fix=UNEVEN_FIX.format(rank=rank),
        confidence=0.95,
        cause=CAUSE_UNEVEN,
    )


def _short_ranks(a: Analysis) -> list[tuple[int, int, int]]:
    """(rank, its steps, the others' fewest) for live ranks out of their loop one step or more
    short, where no DataLoader was seen (with one, `data_ran_out` decides: a rank whose loader
    did not end early left its loop for another reason)."""
    inside = {r: v for r, v in a.views.items() if v.in_loop and v.steps is not None}
    if not inside or not any(v.waiting for v in inside.values()):
        return []
    top = min(v.steps for v in inside.values())  # type: ignore[type-var]
    out = []
    for r, v in sorted(a.views.items()):
        if r in a.explained or r in a.causes or v.steps is None or v.in_loop is not False or not v.waiting:
            continue  # a short rank outside any collective: `behind` names it where it is
        if loader_passes(v):
            continue
        if v.steps <= top:  # the others took as many and are inside their next step, or more
            out.append((r, v.steps, top))
    return out


def uneven_data(a: Analysis) -> None:
    """A rank out of its training loop with fewer steps, while the others wait inside theirs,
    where no DataLoader tells (a loop over a plain iterator): likely uneven data, said with
    what would decide.

    Its next call may be a collective (a barrier before saving, a validation sync): that is a
    consequence, not a desync to align.
    """
    if a.lost:
        return
    data_ran_out(a)
    for rank, mine, top in _short_ranks(a):
        v = a.views[rank]
        others = sorted(r for r, o in a.views.items() if o.in_loop and o.waiting)
        w = v.waits[0] if v.waits else None
        nxt = f"; it went on to {w['op']} #{w['seq']} on {w['group']} at {w.get('call_site', '?')}" if w else ""
        loop = v.snap.get("loop") or "its training loop"
        a.findings.append(
            Finding(
                severity="critical",
                issue=(f"rank {rank} ran out of data: it left {loop} after {mine} training step(s) while "
                       f"{format_ranks(others)} {'waits' if len(others) == 1 else 'wait'} in step {top + 1}{nxt}"),
                evidence="\n".join(x for x in (
                    f"rank {rank}: {mine} step(s), out of its training loop; the others: {top} step(s), inside it",
                    *shape_lines(a, others), f"rank {rank} main-thread stack (innermost last):",
                    "\n".join(v.record.stack[-8:])) if x),
                ranks=[rank],
                fix=UNEVEN_FIX.format(rank=rank) + (
                    "; no DataLoader was seen on this rank, so its data's end was not observed: if it did not run "
                    "out, it left the loop through a rank-dependent branch or an early return"),
                confidence=0.7,
                cause=CAUSE_UNEVEN,
            )
        )
        a.explained.add(rank)
        a.explained.update(others)


def deadlock(a: Analysis) -> None:
    """Ranks that wait for each other on different groups: the groups' order differs between them."""
    if a.lost:
        return
    for end in a.graph.ends:
        if end.kind != "deadlock" or set(end.ranks) <= a.explained:
            continue
        cycle = "; ".join(f"rank {e.src} waits for {e.dst} in {e.wait.label}" for e in end.cycle)
        behind = [r for r, e in a.graph.end_of.items() if e is end and r not in end.ranks]
        tail = f"; {format_ranks(sorted(behind))} wait on them in turn" if behind else ""
        a.findings.append(
            Finding(
                severity="critical",
                issue=f"deadlock between groups: {cycle}{tail}",
                evidence="\n".join(["the cycle of waits:", *(f"  rank {e.src} -> {e.dst}: {e.wait.label}" for e in end.cycle),
                                    *shape_lines(a, behind)]),
                ranks=end.ranks,
                fix=(f"{format_ranks(end.ranks)} issue collectives on these groups in a different order: every member of "
                     "a group must reach its collectives in the same order relative to its other groups (one global "
                     "order of groups, or a rank-independent schedule)"),
                confidence=0.85,
                cause=CAUSE_DEADLOCK,
            )
        )
        a.explained.update(end.ranks)
        a.explained.update(behind)


def _p2p_count(a: Analysis, rank: int, way: str, peer: int) -> int | None:
    """How many sends to / receives from `peer` the rank issued (its wrappers' counts), or None."""
    counts = ((a.views[rank].snap.get("p2p") or {}) if rank in a.views else {}).get(way)
    if not isinstance(counts, dict):
        return None
    count: Any = counts.get(str(peer), counts.get(peer, 0))  # a wrapper's JSON: keys str, or int before
    return int(count)


def _p2p_departure(snap: dict[str, Any]) -> str | None:
    """How a rank's latest point-to-point op departs from the period its earlier ones repeat
    (a stage alternates receive and send per microbatch: a receive where the send was is the
    send it skipped), or None."""
    ops = [str(c.get("op")) for c in (snap.get("history") or []) if c.get("group") == "p2p"][-32:]
    cur = (snap.get("in_collective") or {}).get("op") if (snap.get("in_collective") or {}).get("group") == "p2p" else None
    if cur and (not ops or ops[-1] != cur):
        ops.append(str(cur))
    for period in range(1, 7):
        body = ops[:-1]
        if len(body) < 3 * period:
            break
        if all(body[i] == body[i - period] for i in range(period, len(body))):
            if ops[-1] != ops[-1 - period]:
                return (f"its last point-to-point op was {ops[-1]} where its earlier ones repeat every {period} "
                        f"({', '.join(ops[-1 - period:-1])}): {ops[-1 - period]} was next")
            return None
    return None


def _pending_receives(a: Analysis) -> list[tuple[int, int, str]]:
    """(rank, peer, label) of every receive a rank has pending: the graph's waits, and the
    wrappers' pending list (a rank waits in its oldest op; a later receive may be the one)."""
    from distdiag.hang.waitfor import _PEER

    out: dict[tuple[int, int], str] = {}
    for r, node in sorted(a.graph.nodes.items()):
        if r in a.explained:
            continue
        for w in node.waits:
            if w.peer is not None and w.label.startswith(("recv", "irecv")):
                out.setdefault((r, w.peer), w.label)
        for op in ((a.views[r].snap.get("p2p") or {}).get("pending") or []) if r in a.views else []:
            what, m = str(op).split("(", 1)[0], _PEER.search(str(op))  # the label waitfor reads too
            if m and what in ("recv", "irecv"):
                out.setdefault((r, int(m.group(1))), f"{what} from rank {m.group(1)}")
    return [(r, p, label) for (r, p), label in sorted(out.items())]


def skipped_send(a: Analysis) -> None:
    """A receive waits for ever when its peer issued one send fewer than it posted receives:
    send/recv pair by sender and receiver in order, never by a number (the peer went on, to
    wait elsewhere: in its own receive, in a collective, or at the end). Per pair, the
    wrappers' counts of sends issued and receives posted name the rank that skipped a send,
    when it went past the send: it finished, or waits in a cycle back to the receiver (a rank
    that waits on something else that is stuck is blocked before its send);
    where several ranks fall short, the one whose own ops stopped repeating (the others are
    short because they wait: a stage blocked in its receive sends nothing more); none when
    that does not tell them apart."""
    if a.lost:
        return
    receives = _pending_receives(a)
    short: dict[int, str] = {}
    for rank, peer, label in receives:  # `rank` waits for a message from `peer`
        posted = _p2p_count(a, rank, "received", peer)
        sent = _p2p_count(a, peer, "sent", rank)
        if posted is None or sent is None:
            return
        node = a.graph.nodes.get(peer)
        if node is not None and node.state not in ("waiting", "finished"):
            continue  # it has not reached its send yet (stalled in compute): a rank behind, not a skip
        end = a.graph.end_of.get(peer)
        if node is not None and node.state == "waiting" and (end is None or end.kind != "deadlock"):
            continue  # it waits on something else that is stuck: blocked before its send, not past it
        if sent < posted:
            short[peer] = (f"rank {peer} issued {sent} send(s) to rank {rank}, which posted {posted} receive(s) "
                           f"from it: rank {rank} waits in {label}")
    if len(short) > 1:
        from distdiag.hang.desync import departure

        ran_on = {r: t for r in short if r in a.views
                  if (t := departure(a.views[r].snap, loop=False) or _p2p_departure(a.views[r].snap))}
        if not 0 < len(ran_on) < len(short):
            return
        short = {r: f"{short[r]} ({ran_on[r]})" for r in ran_on}
    if not short:
        return
    culprits = sorted(short)
    waiting = sorted({r for r, _, _ in receives} - set(culprits))
    a.findings.append(
        Finding(
            severity="critical",
            issue=(f"{format_ranks(culprits)} skipped a send: {'; '.join(short[r] for r in culprits)}"),
            evidence="\n".join(["the receives waiting for ever:", *(f"  rank {r} <- {p}: {label}" for r, p, label in receives)]),
            ranks=culprits,
            fix=(f"every send must meet its receive: find the branch where {format_ranks(culprits)} leaves out a "
                 "send (a schedule step, a rank-dependent condition) and make both sides issue the same point-to-point "
                 "ops in the same order"),
            confidence=0.85,
            cause=CAUSE_DESYNC,
        )
    )
    a.explained.update(culprits)
    a.explained.update(waiting)
    # everyone else waits on them in turn: stranded, never blamed
    a.explained.update(r for r, node in a.graph.nodes.items() if node.state == "waiting")


def chain_end(a: Analysis) -> None:
    """A rank at the end of chains that no group-based rule named (those waiting on it directly
    wait in a send/recv, which `behind` does not compare)."""
    if a.lost:
        return
    for end in a.graph.ends:
        if end.kind not in ("computing", "finished") or set(end.ranks) <= a.explained | a.causes:
            continue
        rank = end.ranks[0]
        direct = sorted(a.graph.into(rank), key=lambda e: e.src)
        if not direct:
            continue
        waiters = sorted({e.src for e in direct})
        a.findings.append(
            Finding(
                severity="critical",
                issue=(f"{format_ranks(waiters)} {'waits' if len(waiters) == 1 else 'wait'} for rank {rank} "
                       f"({direct[0].wait.label}), which never got there: {end.text}"),
                evidence="\n".join([*shape_lines(a, [r for r, e in a.graph.end_of.items() if e is end]),
                                    f"rank {rank} main-thread stack (innermost last):",
                                    *a.views[rank].record.stack[-8:]]),
                ranks=[rank],
                fix=(f"find why rank {rank} is stuck or slow there (a rank-dependent branch, I/O, a lock, data "
                     "loading); its peers must reach the matching send/recv or collective"),
                confidence=0.85,
                cause=Cause.BEHIND,
            )
        )
        a.explained.add(rank)


def stranded(a: Analysis) -> None:
    """The ranks a culprit stranded, each with its chain of waits (they are not to blame)."""
    if not a.graph.stranded or not any(f.severity == "critical" for f in a.findings):
        return
    if any(f.cause == CAUSE_DEADLOCK for f in a.findings) and not any(
            e.kind != "deadlock" for e in a.graph.ends):
        return  # the deadlock finding lists them
    ranks = sorted(a.graph.stranded)
    groups = {a.graph.stranded[r][0].wait.group for r in ranks}
    if len(groups) < 2 and all(len(a.graph.stranded[r]) < 2 for r in ranks):
        return  # they all wait in one collective for the culprit: its finding says so
    ends_seen = {id(a.graph.end_of[r]): a.graph.end_of[r] for r in ranks}  # one per end, not per rank
    ends = sorted({r for e in ends_seen.values() for r in e.ranks})
    lines, shapes = counted_shape_lines(a, ranks)
    a.findings.append(
        Finding(
            severity="info",
            issue=(f"{format_ranks(ranks)} {'is' if len(ranks) == 1 else 'are'} stranded, not at fault: "
                   f"{'it waits' if len(ranks) == 1 else 'each waits'} on {format_ranks(ends)} through "
                   + ("the chain below" if shapes == 1 else f"one of the {shapes} chain shapes below")),
            evidence="\n".join(lines),
            ranks=[],
            fix="nothing to fix on these ranks: they resume once the rank at the end of their chain does",
            confidence=0.9,
            cause=Cause.STRANDED,
        )
    )
