"""The wait-for graph: which rank waits for which, across process groups, and where the chains end.

A rank inside collective #N on a group waits for the members of that group that have not
entered #N; a rank inside a `recv` waits for its peer. Following these edges from every
waiting rank leads to the ranks that hold everything up - the *ends*:

- a rank that is not inside any collective (computing, stuck in its data loader or loss,
  finished, raised) or that cannot answer (lost, absent);
- a collective every member entered and none completed (a stall below the program - or, when
  the members' ops differ, a desync the desync rules name);
- a cycle: ranks that wait for each other on different groups (opposite order): a deadlock.

Every other waiting rank is *stranded*: it waits, through a chain of others, on an end. Its
chain ("rank 0 waits for 2 in all_reduce #11 on ranks[0,2]; rank 2 waits for 3 in ...")
explains it; it is never a culprit. Groups are identified by their members (global ranks),
never by a per-process group id. Pure and torch-free: live snapshots (`nodes_from_views`)
and flight-recorder dumps feed the same `Node`s. Linear in ranks x groups (plus the edges).
"""

from __future__ import annotations

import re
from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from distdiag.hang.frontcore import reached
from distdiag.hang.groupid import group_members, members_label
from distdiag.hang.views import RankView, coll_label, where

__all__ = ["Wait", "Node", "Edge", "End", "WaitGraph", "build_graph", "nodes_from_views", "nodes_from_positions", "chain_text",
           "sccs", "cycle_of", "distances_to"]

Group = tuple[int, ...]
_PEER = re.compile(r"\((?:src|dst|peer)=(\d+)\)")


@dataclass(frozen=True)
class Wait:
    """One collective (or point-to-point op) a rank is inside."""

    group: Group
    """The group's members (global ranks); for a send/recv: the rank and its peer."""
    seq: int
    """Its sequence number on that group (-1 for a send/recv, which pair by peer, not number)."""
    label: str
    """How the report names it: 'all_reduce #3 on ranks[0,2] (float32[8x8])', 'recv from rank 1'."""
    key: tuple[object, ...] = ()
    """What must match across the members (op, shape, dtype): differing keys are a desync."""
    peer: int | None = None
    """A send/recv's other rank."""


@dataclass
class Node:
    """One rank as the graph needs it: live snapshot and dump alike."""

    rank: int
    state: str
    """waiting | computing | finished | raised | lost | absent."""
    waits: list[Wait] = field(default_factory=list)
    enqueued: dict[Group, int] | None = None
    """Group -> last collective enqueued (torch's recorder); None: not known, only `waits` say."""
    where: str = ""
    """For an end: where it is ('mesh_workers.py:58 in load_next_microbatch') or why it is gone."""
    in_order: bool = False
    """Its waits are ops of one in-order engine (NCCL's recorder), oldest first: only the first
    can wait on peers, the younger ones are queued behind it on the GPU (hang/frontcore.py,
    the rule dumps follow too). False: each wait may wait on its own (gloo runs the ops of
    different groups on threads of their own; a wrapper's record)."""


@dataclass(frozen=True)
class Edge:
    src: int
    dst: int
    wait: Wait


@dataclass
class End:
    kind: str
    """computing | finished | raised | lost | absent | stall | mismatch | deadlock | unknown."""
    ranks: list[int]
    """The ranks at the end (a stall's or a desync's: the members inside the collective)."""
    text: str
    cycle: list[Edge] = field(default_factory=list)


@dataclass
class WaitGraph:
    edges: dict[int, list[Edge]]
    ends: list[End]
    stranded: dict[int, list[Edge]]
    """Rank -> the chain of waits from it to its end."""
    end_of: dict[int, End]
    """Rank (at an end, or stranded) -> the end its chain reaches."""
    nodes: dict[int, Node] = field(default_factory=dict)
    _into: dict[int, list[Edge]] | None = field(default=None, repr=False)

    def direct(self, rank: int) -> list[Edge]:
        """The ranks `rank` waits for, one edge each (through a hub: its missing members)."""
        out = []
        for e in self.edges.get(rank, []):
            if e.dst >= 0:
                out.append(e)
            else:
                out += [Edge(rank, h.dst, e.wait) for h in self.edges.get(e.dst, []) if h.dst != rank]
        return out

    def into(self, rank: int) -> list[Edge]:
        """The edges of the ranks that wait for `rank` (directly or through a hub), as
        rank -> rank edges; the reverse index is built once."""
        if self._into is None:
            self._into = defaultdict(list)
            for es in self.edges.values():
                for e in es:
                    self._into[e.dst].append(e)
        out = []
        for e in self._into.get(rank, []):
            if e.src >= 0:
                out.append(e)
            else:
                out += [Edge(w.src, rank, w.wait) for w in self._into.get(e.src, []) if w.src != rank]
        return out

    def waits_of(self, rank: int) -> list[Wait]:
        n = self.nodes.get(rank)
        return n.waits if n is not None else []

    def culprits(self) -> list[int]:
        """Ranks to blame: those at an end the program caused (not a stall below it, not a desync)."""
        return sorted({r for e in self.ends if e.kind not in ("stall", "mismatch", "unknown") for r in e.ranks})

    def chains(self, ranks: list[int] | None = None) -> list[str]:
        return [chain_text(self.stranded[r], self.end_of[r]) for r in sorted(ranks or self.stranded) if r in self.stranded]


def _edge_text(e: Edge) -> str:
    return f"rank {e.src} waits for {e.dst} in {e.wait.label}"


def chain_text(chain: list[Edge], end: End | None) -> str:
    """'rank 0 waits for 2 in all_reduce #3 on ranks[0,2]; rank 2 waits for 3 in ...; rank 3 is at ...'."""
    parts = [_edge_text(e) for e in chain]
    if end is not None and end.kind != "deadlock":
        parts.append(end.text)
    elif end is not None:
        parts.append("a deadlock: " + "; ".join(_edge_text(e) for e in end.cycle))
    return "; ".join(parts)


def _entered(node: Node | None, w: Wait, me: int) -> bool:
    """Whether `node` entered (or passed) the collective `w` that rank `me` waits in."""
    if node is None or node.state in ("lost", "absent"):
        return False
    if w.peer is not None:  # a send/recv: the peer is inside the matching recv/send with `me`
        return any(x.peer == me and _pairs(w, x) for x in node.waits)
    if node.enqueued is not None and w.group in node.enqueued:
        return reached(node.enqueued[w.group], w.seq)  # the frontier's rule, as for dumps
    return any(x.group == w.group and x.seq >= w.seq for x in node.waits)


def _pairs(a: Wait, b: Wait) -> bool:
    """A send pairs with a recv (two recvs from each other wait forever); unknown ops pair."""
    if not a.key or not b.key:
        return True
    return ("recv" in str(a.key[0])) != ("recv" in str(b.key[0]))


HUB_MIN = 16
"""From this many members missing from one collective, its waiters point at one hub node (a
negative id) that points at the missing members: waiters + missing edges instead of waiters x
missing (a world-wide collective half the ranks never entered: N^2/4 edges, 67M at 16k)."""


class _Hubs:
    """The hub nodes of one graph: (group, seq) -> id, and each hub's edges to the missing."""

    def __init__(self) -> None:
        self.ids: dict[tuple[Group, int], int] = {}
        self.edges: dict[int, list[Edge]] = {}

    def edge(self, src: int, w: Wait, members: list[int]) -> Edge:
        hub = self.ids.setdefault((w.group, w.seq), -(len(self.ids) + 1))
        if hub not in self.edges:
            self.edges[hub] = [Edge(hub, m, w) for m in members]
        return Edge(src, hub, w)


def _blockers(nodes: dict[int, Node], n: Node, world: int, missing: dict[tuple[Group, int], list[int]],
              hubs: _Hubs) -> list[Edge]:
    """Edges from `n` to the members of its collectives that have not entered them. Which
    members of a collective have not entered it is the same for every waiter: worked out once
    per (group, seq) in `missing`, so the cost is the groups' sizes, not waiters x members;
    past HUB_MIN of them, one edge to the collective's hub."""
    out = []
    for w in n.waits[:1] if n.in_order else n.waits:
        if w.peer is not None:  # a send/recv: whether the peer pairs depends on who asks
            late = [m for m in w.group if m != n.rank and 0 <= m < world and not _entered(nodes.get(m), w, n.rank)]
        else:
            key = (w.group, w.seq)
            if key not in missing:
                missing[key] = [m for m in w.group if 0 <= m < world and not _entered(nodes.get(m), w, -1)]
            if len(missing[key]) >= HUB_MIN and n.rank not in missing[key]:
                out.append(hubs.edge(n.rank, w, missing[key]))
                continue
            late = [m for m in missing[key] if m != n.rank]
        out += [Edge(n.rank, m, w) for m in late]
    return out


def _through_hubs(chain: list[Edge]) -> list[Edge]:
    """A chain or cycle as rank -> rank edges: each hop through a hub (rank -> hub -> member)
    becomes one edge (rank -> member)."""
    out: list[Edge] = []
    for e in chain:
        if e.src < 0 and out:
            out[-1] = Edge(out[-1].src, e.dst, out[-1].wait)
        elif e.src >= 0:
            out.append(e)
    return out


def sccs(ranks: list[int], edges: dict[int, list[Edge]]) -> list[list[int]]:
    """Strongly connected components (Tarjan, iterative: no recursion limit at thousands of ranks)."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on: set[int] = set()
    stack: list[int] = []
    out: list[list[int]] = []
    counter = 0
    for root in ranks:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on.add(v)
            succ = [e.dst for e in edges.get(v, [])]
            if i < len(succ):
                work.append((v, i + 1))
                w = succ[i]
                if w not in index:
                    work.append((w, 0))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return out


def _end_for(rank: int, n: Node | None, nodes: dict[int, Node]) -> End:
    if n is None:
        return End("absent", [rank], f"rank {rank} never reported")
    if n.state != "waiting":
        verb = {"lost": "was lost", "raised": "raised", "finished": "finished", "absent": "never reported"}.get(n.state, "is at")
        return End(n.state, [rank], f"rank {rank} {verb} {n.where}".rstrip())
    w = n.waits[0]
    if w.peer is not None or not w.group:
        return End("unknown", [rank], f"rank {rank} waits in {w.label}")
    inside = {m: next((x for x in nodes[m].waits if x.group == w.group and x.seq == w.seq), None)
              for m in w.group if m in nodes}
    keys = {x.key for x in inside.values() if x is not None}
    if len(keys) > 1:
        return End("mismatch", sorted(inside), f"the members of {w.label} are inside different collectives")
    return End("stall", list(w.group), f"every member entered {w.label} and none completed it")


def cycle_of(comp: list[int], edges: dict[int, list[Edge]]) -> list[Edge]:
    """One cycle through the component, as edges (for the report)."""
    inside = set(comp)
    start, seen, path = comp[0], {comp[0]: 0}, []
    v = start
    while True:
        e = next(e for e in edges[v] if e.dst in inside)
        path.append(e)
        if e.dst in seen:
            return path[seen[e.dst]:]
        seen[e.dst] = len(path)
        v = e.dst


def build_graph(nodes: dict[int, Node], world: int) -> WaitGraph:
    """Edges from every waiting rank, the ends its chains reach, and the stranded ranks' chains."""
    missing: dict[tuple[Group, int], list[int]] = {}
    hubs = _Hubs()
    edges = {r: _blockers(nodes, n, world, missing, hubs) for r, n in nodes.items() if n.state == "waiting"}
    waiting = sorted(edges)
    edges.update(hubs.edges)
    reach: set[int] = set()
    todo = deque(waiting)
    while todo:
        v = todo.popleft()
        if v in reach:
            continue
        reach.add(v)
        todo.extend(e.dst for e in edges.get(v, []))
    comps = sccs(sorted(reach, key=lambda v: (v < 0, v)), edges)  # ranks first, hubs after
    comp_of = {r: i for i, c in enumerate(comps) for r in c}
    ends: list[End] = []
    end_at: dict[int, End] = {}
    stalls: dict[tuple[Group, int], End] = {}
    for comp in comps:
        out = {comp_of[e.dst] for r in comp for e in edges.get(r, [])} - {comp_of[comp[0]]}
        if out:
            continue  # not terminal: its ranks wait on something further along
        if comp[0] < 0 and len(comp) == 1:
            continue  # a hub always points at ranks: never an end by itself
        if len(comp) > 1:
            cycle = cycle_of(comp, edges)
            if cycle and cycle[0].src < 0:  # start the cycle at a rank, not a hub
                cycle = cycle[1:] + cycle[:1]
            end = End("deadlock", [r for r in comp if r >= 0], "", _through_hubs(cycle))
        else:
            end = _end_for(comp[0], nodes.get(comp[0]), nodes)
            if end.kind in ("stall", "mismatch"):  # one end per collective, not one per member
                w = nodes[comp[0]].waits[0]
                end = stalls.setdefault((w.group, w.seq), end)
                if end in ends:
                    end_at[comp[0]] = end
                    continue
        ends.append(end)
        for r in comp:
            end_at[r] = end
    stranded, end_of = _chains(waiting, edges, end_at)
    end_of.update((r, e) for r, e in end_at.items() if r >= 0)
    return WaitGraph(edges=edges, ends=ends, stranded=stranded, end_of=end_of, nodes=nodes)


def distances_to(ends: list[int], edges: dict[int, list[Any]]) -> dict[int, int]:
    """Each node's number of waits to the nearest of `ends`, by one breadth-first pass backwards
    over `edges` (node -> its waits, each with a `dst`); nodes that reach no end are left out."""
    into: dict[int, list[int]] = defaultdict(list)
    for src, es in edges.items():
        for e in es:
            into[e.dst].append(src)
    dist = dict.fromkeys(ends, 0)
    todo = deque(ends)
    while todo:
        v = todo.popleft()
        for src in into.get(v, ()):
            if src not in dist:
                dist[src] = dist[v] + 1
                todo.append(src)
    return dist


def _chains(waiting: list[int], edges: dict[int, list[Edge]], end_at: dict[int, End]) -> tuple[dict[int, list[Edge]], dict[int, End]]:
    """For each waiting rank not at an end: the shortest chain of waits to one.

    One breadth-first pass backwards from every end gives each rank its distance to the
    nearest end; a rank's chain then takes, at each step, its first wait whose rank is one
    step nearer. Linear in the edges (a search from every rank would be ranks x edges).
    """
    ends = sorted(r for r in end_at if r >= 0)  # a hub inside a deadlock is reached through its ranks
    dist = distances_to(ends, edges)
    stranded: dict[int, list[Edge]] = {}
    end_of: dict[int, End] = {}
    for r in waiting:
        if r in end_at or r not in dist:
            continue
        chain: list[Edge] = []
        v = r
        while v not in end_at or v < 0:
            e = next(e for e in edges[v] if dist.get(e.dst) == dist[v] - 1)
            chain.append(e)
            v = e.dst
        stranded[r] = _through_hubs(chain)
        end_of[r] = end_at[v]
    return stranded, end_of


# -- from live snapshots (distdiag.hang.views) --------------------------------------------------


class _Members(tuple):  # type: ignore[type-arg]
    """A group's members whose hash is computed once: a tuple hashes all its items on every
    lookup, 512 of them for a data-parallel group at 16k ranks, for every rank's positions."""

    def __hash__(self) -> int:
        h = self.__dict__.get("_h")
        if h is None:
            h = self.__dict__["_h"] = tuple.__hash__(self)
        return h


@lru_cache(maxsize=1 << 16)
def _members(label: str, world: int) -> Group:
    """The members by a group's label, parsed once per label: every member of a 512-rank group
    names it with the same long label, and the graph compares the one tuple it returns."""
    known = group_members(label, world)
    return _Members(known) if known is not None else ()


def _view_wait(rank: int, w: dict[str, Any], world: int) -> Wait:
    op = str(w.get("op") or "?")
    if w.get("group") == "p2p":
        m = _PEER.search(op)
        peer = int(m.group(1)) if m else None
        what = op.split("(", 1)[0]
        shape = "x".join(str(s) for s in (w.get("shape") or [])) or "-"
        if peer is None:
            return Wait((), -1, f"{what} ({w.get('dtype', '?')}[{shape}]), peer unknown")
        way = "from" if what.endswith("recv") else "to"
        return Wait(tuple(sorted({rank, peer})), -1, f"{what} {way} rank {peer} ({w.get('dtype', '?')}[{shape}])",
                    (what,), peer=peer)
    key = tuple(w.get("key") or (op, str(w.get("shape")), w.get("dtype")))
    return Wait(_members(str(w["group"]), world), int(w["seq"]), coll_label(w), key)


def _in_order(v: RankView) -> bool:
    """Whether the rank's waits are all NCCL recorder ops (views.build_views puts them oldest
    first), where only the oldest can wait on peers."""
    if not v.engine_ok or v.record.engine is None or len(v.waits) < 2:
        return False
    backend = {g.group: g.extra.get("backend") for g in v.record.engine.groups}
    return all(w.get("source") == "engine" and backend.get(w["group"]) == "nccl" for w in v.waits)


def nodes_from_views(views: dict[int, RankView], lost: Mapping[int, str], errors: dict[int, dict[str, Any]], world: int) -> dict[int, Node]:
    """The graph's input from the rules' views: lost ranks, ranks that raised (and wait in
    nothing), waiting ranks with their collectives by members, the rest computing/finished."""
    nodes: dict[int, Node] = {}
    for rank in range(world):
        if rank in lost:
            nodes[rank] = Node(rank, "lost", where=f"({lost[rank]})")
            continue
        v = views.get(rank)
        if v is None:
            continue
        err = errors.get(rank)
        enq = {_members(g, world): n for g, n in v.positions.items()} if v.engine_ok else None
        if enq is not None:
            enq.pop((), None)
        if err is not None and not err.get("comm") and not v.waiting:
            nodes[rank] = Node(rank, "raised", enqueued=enq, where=f"{err.get('type')}: {err.get('message')}")
        elif v.waiting:
            nodes[rank] = Node(rank, "waiting", [_view_wait(rank, w, world) for w in v.waits], enq, in_order=_in_order(v))
        else:
            state = "finished" if v.state in ("finished", "final") else "computing"
            nodes[rank] = Node(rank, state, enqueued=enq, where=where(v.record.stack) if state == "computing" else "")
    return nodes


# -- from per-group positions (flight-recorder dumps) --------------------------------------------


def _position_wait(rank: int, members: Group, g: dict[str, Any]) -> Wait:
    op = str(g.get("op") or "?")
    sizes, dtypes = g.get("sizes"), g.get("dtypes")
    shape = f"({dtypes or '?'} {sizes or '-'})"
    peer = g.get("peer")
    if isinstance(peer, int):
        way = "from" if "recv" in op else "to"
        return Wait(tuple(sorted({rank, peer})), -1, f"{op} {way} rank {peer} {shape}", (op,), peer)
    seq = int(g.get("seq", -1))
    return Wait(members, seq, f"{op} #{seq} on {members_label(members)} {shape}", (op, str(sizes), str(dtypes)))


def nodes_from_positions(per_rank: dict[int, dict[Group, dict[str, Any]]], world: int,
                         lost: Mapping[int, str] | None = None) -> dict[int, Node]:
    """The graph's input from per-rank, per-group positions (a dump reader's output).

    `per_rank[rank][members]` = {"op", "seq" (last enqueued), "completed" (last completed; absent:
    `state` says), "state", "sizes", "dtypes", "peer" (send/recv)}. A rank is inside a group's
    collective when it enqueued one it has not completed; a rank inside none is `computing`
    (a dump does not say where: the reader may fill `Node.where` from a stack).
    """
    nodes: dict[int, Node] = {r: Node(r, "lost", where=f"({why})") for r, why in (lost or {}).items()}
    for rank, groups in per_rank.items():
        if rank in nodes:
            continue
        waits, enq = [], {}
        for members, g in groups.items():
            seq = int(g.get("seq", -1))
            if not isinstance(g.get("peer"), int):
                enq[tuple(members)] = seq
            done = g.get("completed")
            open_ = (int(done) < seq) if done is not None else g.get("state") not in ("completed", None)
            if open_:
                waits.append(_position_wait(rank, tuple(members), g))
        nodes[rank] = Node(rank, "waiting" if waits else "computing", waits, enq)
    return nodes
