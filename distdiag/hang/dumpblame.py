"""Findings from a dumped job's wait-for graph (hang/frontier.py): the culprits at the ends of
the chains of waits, each with the cause the dump supports and, where the dump cannot decide
between causes, the observation that would; the stranded ranks in one lower-severity finding.

Only culprits are named in critical findings. A stall below the program (every member inside
the same op, none completed) names no rank. Torch-free.
"""

from __future__ import annotations

from collections import defaultdict

from distdiag.hang.dumpgroups import RankDump, group_label, op_text
from distdiag.hang.frontier import Attribution, Edge, End, Step, kernel_started
from distdiag.hang.records import Cause, SilentReason
from distdiag.report.model import Finding
from distdiag.report.render import format_ranks

__all__ = ["findings_from", "chain_text", "where_in_dump", "NO_DUMP", "CHAIN_LINES"]

NO_DUMP = "no dump file for this rank (it died, or hung before it could write one)"
CHAIN_LINES = 12
"""Chains written out rank by rank; beyond this, one line per chain shape."""


def _edge_text(e: Edge) -> str:
    how = "never entered it" if e.kind == "missing" else "is held by older work of its own"
    return f"rank {e.src} waits for {e.dst} in {e.step.text} ({e.dst} {how})"


def chain_text(chain: list[Edge]) -> str:
    return "; ".join(_edge_text(e) for e in chain)


def where_in_dump(d: RankDump | None, world: int) -> str:
    """What a rank's dump says of where it is, when it has nothing pending."""
    if d is None:
        return "it wrote no dump"
    if d.empty:
        return "its dump holds no entries: nothing in flight (stalled outside any collective, or its recorder was off)"
    done = [g for g in d.groups.values() if g.ops and g.members]
    last = max(done, key=lambda g: g.ops[-1].created_ns, default=None)
    if last is None or last.last is None:
        return "its dump shows it inside no collective"
    o = last.last
    site = f", called at {o.frames[0]}" if o.frames else ""
    seq = "" if o.p2p else f" #{o.seq}"
    return f"its dump shows it inside no collective; last recorded: {op_text(o)}{seq} on {group_label(last, world)}{site}"


def _waiters(a: Attribution, end: End) -> dict[Step, list[int]]:
    """The ops the ranks waiting directly on the end wait in, and who waits in each."""
    out: dict[Step, list[int]] = defaultdict(list)
    seen: set[tuple[object, int, int]] = set()
    for es in a.edges.values():
        for e in es:
            if e.dst in end.ranks and (e.step.key, e.step.op.seq, e.src) not in seen:
                seen.add((e.step.key, e.step.op.seq, e.src))
                same = next((s for s in out if s.key == e.step.key and s.op.seq == e.step.op.seq and not s.op.p2p), e.step)
                out[same].append(e.src)
    return out


def _waited_one(s: Step, ranks: list[int]) -> str:
    if s.op.p2p:  # the end never posted its side of the transfer
        want = "recv" if s.op.op == "send" else "send"
        return f"the {want} matching rank {s.rank}'s {op_text(s.op)} on {s.label}"
    return f"{s.text} that {format_ranks(sorted(ranks))} {'waits' if len(ranks) == 1 else 'wait'} in"


def _waited_text(a: Attribution, end: End) -> tuple[str, list[int]]:
    """('all_gather #2 on ranks[2,3] that rank 2 waits in, nor ...', every waiter)."""
    waits = sorted(_waiters(a, end).items(), key=lambda kv: (-len(kv[1]), kv[0].text))
    parts = [_waited_one(s, rs) for s, rs in waits[:3]]
    more = f" (and {len(waits) - 3} more ops)" if len(waits) > 3 else ""
    return ", nor ".join(parts) + more, sorted({r for rs in dict(waits).values() for r in rs})


def _behind_them(a: Attribution, end: End) -> str:
    behind = sorted(r for r, e in a.end_of.items() if e is end and r in a.chains)
    if not behind:
        return ""
    verb = "waits" if len(behind) == 1 else "wait"
    return f"\n{format_ranks(behind)} ({len(behind)}) {verb} on it, directly or through others (see the stranded ranks)"


def _idle(a: Attribution, end: End, dumps: dict[int, RankDump]) -> Finding:
    r = end.ranks[0]
    what, _ = _waited_text(a, end)
    return Finding(
        severity="critical", ranks=[r], confidence=0.8, cause=Cause.BEHIND,
        issue=f"rank {r} never entered {what}; {where_in_dump(dumps.get(r), a.world)}",
        evidence=(f"rank {r} has nothing pending in its dump and its enqueued count is below what the others wait in: "
                  "it stopped issuing collectives (a host stall), it did not fail in one" + _behind_them(a, end)),
        fix=(f"find why rank {r} stopped before this collective: its Python stack (py-spy dump --pid, or its "
             "log's last lines) decides between a data loader or I/O stall, a lock or a thread holding the GIL, "
             "a rank-dependent branch or an early exit; the dump alone cannot tell them apart"),
    )


def _stale(a: Attribution, end: End) -> Finding:
    r = end.ranks[0]
    pending = a.stale[r]
    groups = sorted({s.label for s, _ in pending})
    s, peer = pending[0]
    missed, _ = _waited_text(a, end)
    also = f"; its peers also wait on it in {missed}" if missed else ""
    return Finding(
        severity="critical", ranks=[r], confidence=0.75, cause=Cause.STALE_COMPLETION,
        issue=(f"rank {r} stopped discovering the completion of its own work: {len(pending)} op(s) on "
               f"{len(groups)} group(s) its peers completed still show pending on it (e.g. {s.text}, completed by "
               f"rank {peer}){also}: the signature of a GPU error on rank {r}"),
        evidence=("a collective completes on one member only once every member's kernel ran it; rank "
                  f"{r}'s recorder shows them unfinished, so its watchdog stopped seeing its GPU's events:\n"
                  + "\n".join(f"  {x.text}: completed by rank {p}" for x, p in pending[:6])
                  + _behind_them(a, end)),
        fix=(f"look at rank {r}'s log for a CUDA or NCCL error and at its node's kernel log for Xid errors "
             "(dmesg); those decide between a GPU error and a watchdog thread that hung on rank "
             f"{r} (then its GPU is fine and its process's threads are where to look)"),
    )


def _no_dump(a: Attribution, end: End) -> Finding:
    what, _ = _waited_text(a, end)
    waited = f"; the others wait on it in {what}" if what else ""
    return Finding(
        severity="critical", ranks=list(end.ranks), confidence=0.9, cause=SilentReason.NO_DUMP.cause,
        issue=f"{format_ranks(end.ranks)} lost during the dumped job: {NO_DUMP}{waited}", evidence="",
        fix=("look for the process's end: the kernel log (dmesg: OOM killer, segfault), the launcher's per-worker exit "
             "code, the node's health; a rank blocked in destroy_process_group() may also write no dump"),
    )


def _not_started(a: Attribution, end: End) -> Finding:
    r = end.ranks[0]
    s = end.step
    assert s is not None
    started = sorted(m for m in s.members if m != r and (o := a.oldest.get(m)) is not None and kernel_started(a, o))
    return Finding(
        severity="critical", ranks=[r], confidence=0.7, cause=Cause.NOT_STARTED,
        issue=(f"rank {r} enqueued {s.text} but never started it, while {format_ranks(started)} did: its GPU stream "
               "is still busy with earlier work of its own"),
        evidence="NCCL's timing is on ('started' recorded): every member entered the collective, only this one's "
                 "kernel has not begun" + _behind_them(a, end),
        fix=(f"look at what rank {r} queued before this collective: a long or hung kernel, or a collective on another "
             "group that waits on its own peers (py-spy dump --native on the rank, nvidia-smi for a busy GPU)"),
    )


def _stall(end: End) -> Finding:
    s = end.step
    assert s is not None
    if s.op.p2p:
        issue = (f"{format_ranks(sorted(end.ranks))} are both inside the matching {s.text.split(' on ')[0]} and its "
                 "counterpart: one transfer in flight that does not complete, a stall below the program")
    else:
        issue = (f"every member of {s.label} is inside {op_text(s.op)} #{s.op.seq} and none completed it: "
                 "a stall below the program (network, fabric, GPU), not a desync")
    return Finding(
        severity="critical", ranks=[], confidence=0.5, cause=Cause.COLLECTIVE_STALL, issue=issue,
        evidence="the op is each member's oldest unfinished work: nothing older of their own holds it",
        fix=("check the fabric and the GPUs (NCCL_DEBUG=INFO, link errors, Xid errors in dmesg); with "
             "TORCH_NCCL_ENABLE_TIMING=1 the dump says which member's kernel started it, which decides "
             "between a rank whose GPU is busy with something else and a transfer stuck in the network"),
    )


def _mismatch(a: Attribution, end: End) -> Finding:
    s = end.step
    assert s is not None
    inside = [o for m in s.members if (o := a.oldest.get(m)) is not None and o.key == s.key and o.op.seq == s.op.seq]
    by: dict[str, list[int]] = defaultdict(list)
    for o in inside:
        by[f"{o.op.op} {o.op.sizes} {','.join(o.op.dtypes or [])}"].append(o.rank)
    sides = sorted(by.items(), key=lambda kv: len(kv[1]))
    odd = sides[0][1] if len(sides) == 2 and len(sides[0][1]) < len(sides[1][1]) else sorted(end.ranks)
    return Finding(
        severity="critical", ranks=sorted(odd), confidence=0.7, cause=Cause.DESYNC,
        issue=f"the members of {s.label} are inside different collectives at #{s.op.seq}: "
              + "; ".join(f"{format_ranks(rs)} in {k}" for k, rs in sides),
        evidence="every member entered the same sequence number with a different op, size or dtype",
        fix="every rank must issue the same collectives in the same order with matching shapes: look at the call "
            "sites of the two ops for a rank-dependent branch",
    )


def _record_desync(s: Step, by: dict[str, list[int]], stalled: bool) -> Finding:
    sides = sorted(by.items(), key=lambda kv: len(kv[1]))
    odd = sides[0][1] if len(sides[0][1]) < len(sides[1][1]) else []
    return Finding(
        severity="critical" if odd or stalled else "error", ranks=odd, confidence=0.7 if odd else 0.5,
        cause=Cause.DESYNC,
        issue=f"desync on {s.label} at #{s.op.seq}: the members recorded different collectives there: "
              + "; ".join(f"{format_ranks(rs)} {k}" for k, rs in sides),
        evidence="each rank's recorder lists its collectives on the group by sequence number; at this number they "
                 "differ" + ("" if odd else " (no majority: the dump does not say which side departed)"),
        fix="every rank must issue the same collectives in the same order with matching shapes: look at the call "
            "sites of these ops for a rank-dependent branch",
    )


def _deadlock(a: Attribution, end: End) -> Finding:
    return Finding(
        severity="critical", ranks=sorted(end.ranks), confidence=0.7, cause=Cause.DEADLOCK,
        issue=f"{format_ranks(sorted(end.ranks))} wait on each other across groups: {chain_text(end.cycle)}",
        evidence="a cycle of waits: each rank's oldest unfinished op waits on the next rank's",
        fix="the ranks issue collectives on these groups in different orders: issue them in one order on every rank",
    )


def _fresh(a: Attribution, end: End) -> Finding:
    r = end.ranks[0]
    s = end.step
    assert s is not None
    return Finding(
        severity="warning", ranks=[r], confidence=0.4, cause=Cause.IN_FLIGHT,
        issue=(f"the waits end at rank {r}, which was still issuing work when it dumped (its oldest unfinished op, "
               f"{s.text}, is seconds old while the others' are older): it may have been on its way"),
        evidence="an op a few seconds old at dump time is in flight, not stuck",
        fix=f"a second dump of rank {r} a little later (or its stack) decides whether it moves on or loops",
    )


def _stranded(a: Attribution) -> Finding | None:
    ranks = sorted(a.chains)
    if not ranks:
        return None
    ends = sorted({r for x in ranks for r in a.end_of[x].ranks})
    if len(ranks) <= CHAIN_LINES:
        lines = [chain_text(a.chains[r]) for r in ranks]
    else:
        shapes: dict[tuple[str, int, tuple[int, ...], int], list[int]] = defaultdict(list)
        for r in ranks:
            c = a.chains[r]
            shapes[(c[0].step.op.op, len(c[0].step.members), tuple(a.end_of[r].ranks), len(c))].append(r)
        lines = [f"{format_ranks(rs)} ({len(rs)}): {'wait' if len(rs) > 1 else 'waits'} in {op} on a {n}-rank group, "
                 + (f"through {k - 1} other rank(s), " if k > 1 else "directly ") + f"on {format_ranks(list(end))}"
                 for (op, n, end, k), rs in sorted(shapes.items(), key=lambda kv: -len(kv[1]))]
    return Finding(
        severity="info", ranks=[], confidence=0.9, cause=Cause.STRANDED,
        issue=f"{format_ranks(ranks)} {'is' if len(ranks) == 1 else 'are'} stranded, not at fault: "
              f"{'it waits' if len(ranks) == 1 else 'each waits'} on {format_ranks(ends)} through the chains below",
        evidence="\n".join(lines[:CHAIN_LINES * 2]),
        fix="nothing to fix on these ranks: they resume once the rank at the end of their chain does",
    )


_ORDER = {"no_dump": 0, "stale": 1, "idle": 2, "not_started": 3, "deadlock": 4, "mismatch": 5, "stall": 6, "fresh": 7}


def findings_from(a: Attribution, dumps: dict[int, RankDump]) -> list[Finding]:
    """The culprits' findings, most certain first, then the stranded ranks."""
    out: list[Finding] = []
    for end in sorted(a.ends, key=lambda e: (_ORDER.get(e.kind, 9), e.ranks)):
        if end.kind == "idle":
            out.append(_idle(a, end, dumps))
        elif end.kind == "stale":
            out.append(_stale(a, end))
        elif end.kind == "no_dump":
            out.append(_no_dump(a, end))
        elif end.kind == "not_started":
            out.append(_not_started(a, end))
        elif end.kind == "stall":
            out.append(_stall(end))
        elif end.kind == "mismatch":
            out.append(_mismatch(a, end))
        elif end.kind == "deadlock":
            out.append(_deadlock(a, end))
        elif end.kind == "fresh":
            out.append(_fresh(a, end))
    mismatched = {(e.step.key, e.step.op.seq) for e in a.ends if e.kind == "mismatch" and e.step is not None}
    for s, by in a.desyncs[:3]:
        if (s.key, s.op.seq) not in mismatched:  # a desync the members are still inside is named above
            out.append(_record_desync(s, by, bool(a.chains)))
    lost = [f for f in out if f.cause == SilentReason.NO_DUMP.cause]
    if len(lost) > 1:  # one finding for every rank without a dump
        merged = sorted(r for f in lost for r in f.ranks)
        out = [f for f in out if f not in lost]
        out.insert(0, _no_dump(a, End("no_dump", merged)))
    stranded = _stranded(a)
    if stranded is not None and any(f.severity == "critical" for f in out):
        out.append(stranded)
    return out
