"""Who holds a dumped job up, from what the fields of torch's flight recorder mean.

A dump is a snapshot taken at the first failure, not a list of hung ops: healthy ranks dump
while their work is legitimately in flight. So blame is not "has a pending entry" but:

1. Groups by their members and desc (hang/dumpgroups.py), never by the per-process `pg_id`.
2. An entry is done when its completion was discovered (`state` 'completed', or `retired`,
   gloo's only sign); the per-op entries of a coalesced batch take their closing entry's state.
3. Per group, the frontier (hang/frontcore.py, which the live path shares): the first
   `collective_seq_id` no member completed. A collective
   completes on one member only once every member's kernel ran it, so whatever one member
   completed every member entered, whatever its own (possibly frozen) record says. Members whose
   enqueued count is below the frontier never entered it: only they can be blamed by that group.
4. Send/recv pair by (sender, receiver) in order, never by `p2p_seq_id` (a per-process counter).
   A send whose receiver posted the matching recv is one transfer in flight, not a deadlock.
5. Only each rank's oldest unfinished op can wait on peers: younger ones are queued behind it on
   the stream. It waits on the members that never entered it, or that entered it but are
   themselves queued behind older work.
6. The chains of waits end at the culprits: a rank with no dump, a rank behind with nothing
   pending (a host stall: data, I/O, a lock, the GIL), a rank whose completions stopped being
   discovered while its peers completed the same ops (a GPU error's signature: `stale`), a cycle.
   Every rank that reaches one is stranded. An op every member is inside that none completed is
   a stall below the program (or, when the members' ops differ, a desync).
7. An op created within FRESH_S of the newest entry of any rank is in flight, when older work is
   stuck: a rank whose oldest unfinished op is that young was still issuing work.

Pure and torch-free; linear in entries (plus groups x members).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from distdiag.hang.dumpgroups import GroupState, OpRecord, RankDump, group_label, op_text
from distdiag.hang.frontcore import Pos as _Pos
from distdiag.hang.frontcore import completed_anywhere, never_entered
from distdiag.hang.waitfor import cycle_of, distances_to, sccs  # the wait-for graph's Tarjan (iterative) and its cycle

__all__ = ["FRESH_S", "STALE_OPS", "Step", "Edge", "End", "Attribution", "attribute", "kernel_started", "sizes_may_differ"]

FRESH_S = 5.0
"""An op younger than this at dump time (the newest `time_created_ns` of any rank) is in flight."""
STALE_OPS = 3
"""Ops a rank still shows pending that a peer completed, over at least two groups, for its
completion discovery to count as stale (one or two are the watchdog's ~100 ms discovery lag)."""

Key = tuple[tuple[int, ...], str, str]


def sizes_may_differ(op: str) -> bool:
    """all_to_all(v), gather and scatter carry different sizes on different ranks by design."""
    return op in ("gather", "scatter") or "all_to_all" in op or "alltoall" in op


@dataclass(frozen=True, eq=False)
class Step:
    """One op of one rank on one group (compared and hashed by identity: one per entry)."""

    rank: int
    key: Key
    label: str
    members: tuple[int, ...]
    op: OpRecord

    @property
    def text(self) -> str:
        """'all_reduce #3 on ranks[0,2] (DP)', 'send to 3 on ranks[0,4,8,12] (PIPELINE...)'."""
        seq = "" if self.op.p2p else f" #{self.op.seq}"
        return f"{op_text(self.op)}{seq} on {self.label}"


@dataclass(frozen=True)
class Edge:
    src: int
    dst: int
    kind: str
    """'missing': dst never entered the op; 'queued': dst entered it but is held by older work."""
    step: Step


@dataclass
class End:
    kind: str
    """no_dump | stale | idle | not_started | fresh | stall | mismatch | deadlock."""
    ranks: list[int]
    step: Step | None = None
    cycle: list[Edge] = field(default_factory=list)


@dataclass
class Attribution:
    world: int
    steps: dict[int, list[Step]]
    oldest: dict[int, Step]
    """rank -> its oldest op not done (by itself or, for a collective, by any member)."""
    stale: dict[int, list[tuple[Step, int]]]
    """rank -> (op pending on it, a member that completed it), when discovery is stale."""
    edges: dict[int, list[Edge]]
    ends: list[End]
    end_of: dict[int, End]
    chains: dict[int, list[Edge]]
    """Stranded rank -> its shortest chain of waits to an end."""
    fresh: set[int] = field(default_factory=set)
    lost: set[int] = field(default_factory=set)
    pos: dict[Key, dict[int, _Pos]] = field(default_factory=dict)
    """Per group, each member's position on its collective sequence."""
    desyncs: list[tuple[Step, dict[str, list[int]]]] = field(default_factory=list)
    """Collectives the members recorded differently at one sequence number: (one member's
    entry, what each recorded -> ranks), the earliest per group."""

    def culprits(self) -> list[int]:
        return sorted({r for e in self.ends if e.kind not in ("stall", "fresh") for r in e.ranks})

    def into(self, rank: int) -> list[Edge]:
        return [e for es in self.edges.values() for e in es if e.dst == rank]


# -- 1-2. each rank's ops, in order, with completion -------------------------------------------


def _is_closer(op: OpRecord) -> bool:
    return op.op == "coalesced" or op.op.endswith("_coalesced")


def _coalesced_states(g: GroupState) -> None:
    """Per-op entries of a coalesced batch have no events and stay 'scheduled' for ever: they
    take the state of the batch's closing entry (same group, same sequence number)."""
    closers = {(o.p2p, o.seq): o.done for o in g.ops if _is_closer(o)}
    batch = Counter((o.p2p, o.seq) for o in g.ops if not _is_closer(o))
    for o in g.ops:
        if _is_closer(o):
            continue
        if (o.p2p, o.seq) in closers:
            o.done = closers[(o.p2p, o.seq)]
        elif batch[(o.p2p, o.seq)] > 1:
            # a batch (its ops share one number) without its closing entry: an only-active dump
            # left the closer out because it completed, or the batch is still being issued (its
            # kernels start at the close): either way its ops wait on no peer
            o.done = True


def _rank_steps(rd: RankDump, world: int) -> list[Step]:
    out = []
    for g in rd.groups.values():
        if not g.members or len(g.members) < 2:
            continue  # a one-rank group waits on nobody
        _coalesced_states(g)
        label = group_label(g, world)
        out += [Step(rd.rank, g.key, label, g.members, o) for o in g.ops if not _is_closer(o)]
    out.sort(key=lambda s: (s.op.created_ns, s.op.order))
    return out


# -- 3. per group: positions and the frontier ----------------------------------------------------


def _position(g: GroupState) -> _Pos:
    """Last collective enqueued and completed on one member, from pg_status where it counts
    collectives only, else from the entries (an only-active dump lists what is pending)."""
    colls = [o for o in g.ops if not o.p2p and not _is_closer(o)]
    done = max((o.seq for o in colls if o.done), default=None)
    if g.position_from == "pg_status" and not g.p2p_only:
        enq, comp = g.enqueued, g.completed
    elif g.completion_unknown and colls and done is None:
        # no completion recorded at all (no pg_status, no state, no `retired`): each rank's last
        # recorded collective on the group is taken as the one it is in
        enq, comp = g.enqueued, g.completed
    elif colls:
        pending = [o.seq for o in colls if not o.done]
        enq = max(o.seq for o in colls)
        comp = min(pending) - 1 if pending else enq
    else:
        return _Pos(None, None)
    if done is not None:
        comp = done if comp is None else max(comp, done)
    return _Pos(enq, comp, g.started if g.position_from == "pg_status" else None)


def _positions(dumps: dict[int, RankDump]) -> dict[Key, dict[int, _Pos]]:
    out: dict[Key, dict[int, _Pos]] = defaultdict(dict)
    for rank, rd in dumps.items():
        for g in rd.groups.values():
            if g.members and len(g.members) > 1 and not g.p2p_only:
                out[g.key][rank] = _position(g)
    return out


# -- the rank's state: stale discovery, its oldest unfinished op ---------------------------------


def _stale(steps: list[Step], top: dict[Key, int], pos: dict[Key, dict[int, _Pos]]) -> list[tuple[Step, int]]:
    """The collectives this rank shows pending that a peer completed (GPU error: frozen states)."""
    out = []
    for s in steps:
        if s.op.p2p or s.op.done or s.op.seq > top.get(s.key, -1):
            continue
        peer = next((m for m, p in pos[s.key].items() if m != s.rank and (p.completed or -1) >= s.op.seq), None)
        if peer is not None:
            out.append((s, peer))
    return out if len(out) >= STALE_OPS and len({s.key for s, _ in out}) >= 2 else []


def _oldest(steps: list[Step], top: dict[Key, int]) -> Step | None:
    for s in steps:
        if s.op.done or (not s.op.p2p and s.op.seq <= top.get(s.key, -1)):
            continue
        if s.op.p2p and s.op.peer is None:
            continue  # a send/recv whose peer the dump does not name
        return s
    return None


def _fresh(oldest: dict[int, Step]) -> set[int]:
    """Ranks whose oldest unfinished op is in flight: created within FRESH_S of the newest entry
    of any rank, while some rank's oldest unfinished op is older than that (a hang to compare with)."""
    times = [s.op.created_ns for s in oldest.values() if s.op.created_ns]
    if not times:
        return set()
    now = max(times)
    if now - min(times) < FRESH_S * 1e9:
        return set()
    return {r for r, s in oldest.items() if s.op.created_ns and now - s.op.created_ns < FRESH_S * 1e9}


# -- 4-5. wait edges from each rank's oldest unfinished op ---------------------------------------


def _pending_match(a: Attribution, s: Step) -> Step | None:
    """The peer's first pending op that pairs with send/recv `s` (same group, opposite way)."""
    want = "recv" if s.op.op == "send" else "send"
    for x in a.steps.get(s.op.peer if s.op.peer is not None else -1, []):
        if x.key == s.key and x.op.p2p and x.op.op == want and x.op.peer == s.rank and not x.op.done:
            return x
    return None


def _p2p_edges(a: Attribution, s: Step) -> list[Edge]:
    peer = s.op.peer
    assert peer is not None
    match = _pending_match(a, s) if peer not in a.lost else None
    if match is None:
        return [Edge(s.rank, peer, "missing", s)]
    if a.oldest.get(peer) == match and peer not in a.stale:
        return []  # both sides inside the one transfer: in flight (or a stall below the program)
    return [Edge(s.rank, peer, "queued", s)]


def _coll_edges(a: Attribution, s: Step, pos: dict[Key, dict[int, _Pos]],
                memo: dict[tuple[Key, int], tuple[list[int], list[int]]]) -> list[Edge]:
    """Edges to the members that never entered `s`, else to those held by older work of their
    own. Who they are is the same for every member inside it: worked out once per collective."""
    at = (s.key, s.op.seq)
    if at not in memo:
        missing = never_entered(s.members, pos.get(s.key, {}), s.op.seq, a.lost)
        held = [] if missing else [m for m in s.members if _held(a, m, s)]
        memo[at] = (missing, held)
    missing, held = memo[at]
    if missing:
        return [Edge(s.rank, m, "missing", s) for m in missing if m != s.rank]
    return [Edge(s.rank, m, "queued", s) for m in held if m != s.rank]


def _held(a: Attribution, member: int, s: Step) -> bool:
    """The member entered `s` but something older of its own comes first (or its record is stale)."""
    o = a.oldest.get(member)
    if member in a.stale or o is None or o.key != s.key or o.op.seq != s.op.seq:
        return True
    return _not_started(a, o)


def kernel_started(a: Attribution, o: Step) -> bool | None:
    """Whether the rank's kernel started the op: pg_status's last started where NCCL's timing
    records it, else the entry's state; None when nothing says."""
    p = a.pos.get(o.key, {}).get(o.rank)
    if p is not None and p.started is not None:
        return p.started >= o.op.seq
    return {"started": True, "scheduled": False}.get(o.op.state)


def _not_started(a: Attribution, o: Step) -> bool:
    """With NCCL's timing on ('started' recorded), a member whose kernel never started the op
    that others started: its GPU stream is busy with older work of its own."""
    if o.op.p2p or kernel_started(a, o) is not False:
        return False
    return any((x := a.oldest.get(m)) is not None and x.key == o.key and x.op.seq == o.op.seq
               and kernel_started(a, x) for m in o.members if m != o.rank)


# -- 6. where the chains end -----------------------------------------------------------------------


def _terminal_components(a: Attribution) -> list[list[int]]:
    ranks = sorted(set(a.edges) | {e.dst for es in a.edges.values() for e in es} | set(a.stale) | a.lost | set(a.oldest))
    comps = sccs(ranks, a.edges)  # type: ignore[arg-type]
    comp_of = {r: i for i, c in enumerate(comps) for r in c}
    return [c for i, c in enumerate(comps) if not {comp_of[e.dst] for r in c for e in a.edges.get(r, [])} - {i}]


def _end_of_rank(a: Attribution, rank: int, stalls: dict[tuple[Key, object], End], waited: set[int]) -> End | None:
    if rank in a.lost:
        return End("no_dump", [rank])
    if rank in a.stale:
        return End("stale", [rank], a.stale[rank][0][0])
    s = a.oldest.get(rank)
    if s is None:
        return End("idle", [rank]) if rank in waited else None
    if rank in a.fresh:
        return End("fresh", [rank], s) if rank in waited else None
    if _not_started(a, s):
        return End("not_started", [rank], s)
    key: tuple[Key, object] = (s.key, tuple(sorted((rank, s.op.peer or 0))) if s.op.p2p else s.op.seq)
    if key in stalls:
        stalls[key].ranks.append(rank)
        return None
    inside = [o for m in s.members if (o := a.oldest.get(m)) is not None and o.key == s.key and o.op.seq == s.op.seq]
    kind = "mismatch" if not s.op.p2p and _differ(inside) else "stall"
    stalls[key] = End(kind, [rank], s)
    return stalls[key]


def _differ(inside: list[Step]) -> bool:
    """Members inside one sequence number with different collectives (or, where sizes must
    match, different sizes or dtypes)."""
    ops = {x.op.op for x in inside}
    if len(ops) > 1:
        return True
    if sizes_may_differ(next(iter(ops), "")):
        return False
    return len({(str(x.op.sizes), str(x.op.dtypes)) for x in inside}) > 1


def _chains(a: Attribution) -> None:
    """Each waiting rank not at an end: its shortest chain of waits to one (BFS backwards)."""
    dist = distances_to(list(a.end_of), a.edges)  # type: ignore[arg-type]
    for r in sorted(a.edges):
        if r in a.end_of or r not in dist or not a.edges[r]:
            continue
        chain, v = [], r
        while v not in a.end_of:
            e = next(e for e in a.edges[v] if dist.get(e.dst) == dist[v] - 1)
            chain.append(e)
            v = e.dst
        a.chains[r] = chain
    for r, chain in a.chains.items():
        a.end_of[r] = a.end_of[chain[-1].dst]


def _ends(a: Attribution) -> None:
    stalls: dict[tuple[Key, object], End] = {}
    waited = {e.dst for es in a.edges.values() for e in es}
    for comp in _terminal_components(a):
        if len(comp) > 1:
            end: End | None = End("deadlock", comp, cycle=cycle_of(comp, a.edges))  # type: ignore[arg-type]
        else:
            end = _end_of_rank(a, comp[0], stalls, waited)
        if end is None:
            continue
        if end not in a.ends:
            a.ends.append(end)
    for e in a.ends:
        for r in e.ranks:
            a.end_of[r] = e
    for e in stalls.values():  # members joined a stall after it was listed
        for r in e.ranks:
            a.end_of[r] = e


def _what(s: Step) -> str:
    """What must match across the members at one sequence number: the op, and its sizes and
    dtypes unless they differ by design (all_to_all, gather, scatter)."""
    if sizes_may_differ(s.op.op):
        return s.op.op
    return f"{s.op.op} {s.op.sizes} {','.join(s.op.dtypes or [])}"


def _record_desyncs(steps: dict[int, list[Step]]) -> list[tuple[Step, dict[str, list[int]]]]:
    """Per group, the first sequence number whose collective the members recorded differently
    (completed or not: an all_gather where the others all-reduced may complete, silently wrong)."""
    seen: dict[tuple[Key, int], dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    first: dict[tuple[Key, int], Step] = {}
    for r, ss in steps.items():
        for s in ss:
            if not s.op.p2p:
                seen[(s.key, s.op.seq)][_what(s)].append(r)
                first.setdefault((s.key, s.op.seq), s)
    out: dict[Key, tuple[int, Step, dict[str, list[int]]]] = {}
    for (key, seq), by in seen.items():
        if len(by) > 1 and (key not in out or seq < out[key][0]):
            out[key] = (seq, first[(key, seq)], {k: sorted(v) for k, v in by.items()})
    return [(s, by) for _, s, by in sorted(out.values(), key=lambda x: (x[1].label, x[0]))]


def attribute(dumps: dict[int, RankDump], world: int) -> Attribution:
    """The wait-for graph of a dumped job, from the engine's semantics (see the module doc)."""
    steps = {r: _rank_steps(rd, world) for r, rd in dumps.items()}
    pos = _positions(dumps)
    top = completed_anywhere(pos)  # dumps are NCCL's semantics: what one member completed, all entered
    a = Attribution(world, steps, {}, {}, {}, [], {}, {}, lost={r for r in range(world) if r not in dumps}, pos=pos)
    for r, ss in steps.items():
        stale = _stale(ss, top, pos)
        if stale:
            a.stale[r] = stale
        o = _oldest(ss, top)
        if o is not None:
            a.oldest[r] = o
    a.fresh = _fresh(a.oldest)
    memo: dict[tuple[Key, int], tuple[list[int], list[int]]] = {}
    for r, s in sorted(a.oldest.items()):
        if r in a.stale or r in a.fresh:
            continue
        edges = _p2p_edges(a, s) if s.op.p2p else _coll_edges(a, s, pos, memo)
        if edges:
            a.edges[r] = edges
    _ends(a)
    _chains(a)
    a.desyncs = _record_desyncs(steps)
    return a
