"""Snapshots gathered per node: the writer reads N/8 values, not N (issue 21 item 2).

Once an incident is declared every rank posts its snapshot (distdiag/runtime/incident.py
`post_snapshot`). Each node's leader (local rank 0), unless it writes the report itself, waits
a moment for its node's ranks' snapshots and posts them again as one value, their labels in
one table (`snapwire.pack_many`, under IncidentKeys.node). The writer reads those first and
then, one by one, only the snapshots no leader brought: a node whose leader is dead, stuck or
late, a rank that posted after its leader went on, the writer's own node. Nothing is lost if
no leader ever posts; the writer reads N values then, as before.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from distdiag.runtime import snapwire
from distdiag.runtime.exchange import bounded, poll_interval
from distdiag.runtime.incident import Incident, collect_snapshots

__all__ = ["AGGREGATE_WAIT_S", "NodeReader", "index_key", "node_members", "node_leaders", "aggregate_node", "gather_snapshots"]

log = logging.getLogger("distdiag.runtime.nodes")

AGGREGATE_WAIT_S = 1.0
"""How long a node leader waits for its node's snapshots before it posts those it has (the
rest the writer reads one by one)."""
POLL_S = 0.02


def node_members(infos: dict[int, Any], rank: int) -> list[int]:
    """The ranks on `rank`'s node (its RankInfo rows: same node index and host), itself included."""
    me = infos.get(rank)
    if me is None:
        return [rank]
    return sorted(r for r, i in infos.items() if i.node == me.node and i.host == me.host)


def node_leaders(infos: dict[int, Any], writer: int) -> list[int]:
    """The ranks that post a node's snapshots: local rank 0 of each node of two ranks or more
    (by their RankInfo rows), but the writer."""
    size: dict[tuple[Any, Any], int] = {}
    for i in infos.values():
        size[(i.node, i.host)] = size.get((i.node, i.host), 0) + 1
    return sorted(r for r, i in infos.items() if i.local_rank == 0 and r != writer and size[(i.node, i.host)] >= 2)


def aggregate_node(incident: Incident, members: list[int], *, wait_s: float = AGGREGATE_WAIT_S) -> int:
    """The leader's part: once `members` posted their snapshots (or after wait_s), post them as
    one value; how many it holds (0 for a node of one rank: nothing posted)."""
    if len(members) < 2:
        return 0  # a node of one rank: the writer expects no value from it (node_leaders)
    ex, key = incident.ex, incident.keys.snap
    end = time.monotonic() + wait_s
    # One check a poll for each of the job's N/len(members) leaders: together within the store's budget.
    interval = poll_interval(POLL_S, incident.world // max(len(members), 1))
    while True:
        have = ex.present(key, members)
        if len(have) == len(members) or time.monotonic() >= end:
            break
        time.sleep(interval)
    try:  # posted even when few came: the writer waits for this value, then reads the rest one by one
        value = snapwire.pack_many(collect_snapshots(ex, key, have))
        ex.put(f"{incident.keys.node}/{ex.rank}", value)
        with bounded(f"add {incident.keys.node}/n"):
            number = int(ex.store.add(f"{incident.keys.node}/n", 1))
            # which leader posted the number-th value: the writer reads new values while the
            # snapshots still come in (NodeReader), without looking for them among all leaders
            ex.store.set(f"{index_key(incident)}/{number}", str(ex.rank))
    except Exception as exc:  # noqa: BLE001 - the writer reads this node's snapshots one by one then
        log.debug("could not post the node's snapshots: %s", exc)
        return 0
    return len(have)


def index_key(incident: Incident) -> str:
    """Where the leader of the K-th node value says who it is (`KEY/K`: its rank)."""
    return f"{incident.keys.node}/at"


class NodeReader:
    """The writer's reading ahead: the node values posted so far, found by their numbers
    (`index_key`), unpacked while the other ranks' snapshots still come in (at 16k ranks the
    snapshots arrive over ~1 s, the time the writer otherwise spends idle before it reads and
    parses 2k values). `snaps`: what they brought, by rank; `leaders`: whose value was read."""

    def __init__(self, incident: Incident, cache: dict[str, str]) -> None:
        self.incident = incident
        self.cache = cache
        self.snaps: dict[int, dict[str, Any]] = {}
        self.leaders: set[int] = set()
        self._next = 1
        self.counted = 0
        """How many values the leaders' count said were posted at the last read."""
        self._unseen: set[int] = set()  # numbers counted whose index was not there yet
        self._shared: dict[str, Any] = {}  # one object per distinct sizes / dtypes text (`_share`)

    def read_new(self) -> list[int]:
        """Read the values posted since the last call; the ranks they brought."""
        ex = self.incident.ex
        count = self.counted = ex.count(self.incident.keys.node)
        wanted = sorted(self._unseen | set(range(self._next, count + 1)))
        self._next = max(self._next, count + 1)
        if not wanted:
            return []
        found = ex.collect(index_key(self.incident), wanted)
        self._unseen = set(wanted) - set(found)
        leaders = sorted({v for v in found.values() if type(v) is int and v not in self.leaders})
        self.leaders.update(leaders)
        return self.absorb(ex.collect(self.incident.keys.node, leaders).values() if leaders else ())

    def absorb(self, values: Any) -> list[int]:
        """Unpack node values into `snaps` (a rank already there keeps its first); the new ranks."""
        new = []
        for value in values:
            try:
                node = snapwire.unpack_many(value, self.cache)
            except Exception as exc:  # noqa: BLE001 - a corrupt value: its ranks are read one by one
                log.debug("a node's snapshots could not be unpacked: %s", exc)
                continue
            for rank, snap in node.items():
                if 0 <= rank < self.incident.world and rank not in self.snaps:
                    self.snaps[rank] = snap
                    self._share(snap)
                    new.append(rank)
        return new

    def _share(self, snap: dict[str, Any]) -> None:
        """The recorder entries' sizes and dtypes as one object per distinct value (by its
        text) across the gather: 16k ranks' tails are ~230k entries of a few distinct shapes,
        and the analysis compares them by their text (hang/desync.py record_divergence) once
        per object. Done here, while the writer waits for the other snapshots anyway."""
        engine = snap.get("engine")
        entries = engine.get("entries") if type(engine) is dict else None
        if type(entries) is not list:
            return
        shared = self._shared
        for e in entries:
            if type(e) is not dict:
                continue
            for name in ("sizes", "dtypes"):
                v = e.get(name)
                if type(v) is list:
                    e[name] = shared.setdefault(str(v), v)


def _read_as_they_come(reader: NodeReader, live: list[int], deadline: float) -> None:
    """Until the values of `live` leaders are read (or the deadline), the new ones each poll:
    the last leaders post after the last snapshot is in, and each value is unpacked as it
    comes rather than all once the last came. One rank polling: at its own pace, not the job's
    (0.66 s between polls at 16k ranks). Values counted but not numbered (a leader of an older
    version) are left to the caller's read."""
    while any(r not in reader.leaders for r in live):
        try:
            new = reader.read_new()
        except Exception as exc:  # noqa: BLE001 - the caller reads what is left
            log.debug("could not read the node values: %s", exc)
            return
        if (not new and reader.counted >= len(live)) or time.monotonic() >= deadline:
            return
        if not new:
            time.sleep(POLL_S)


def gather_snapshots(incident: Incident, *, cache: dict[str, str], leaders: list[int],
                     wait_s: float = AGGREGATE_WAIT_S, stats: dict[str, int] | None = None,
                     ahead: NodeReader | None = None) -> dict[int, dict[str, Any]]:
    """The writer's part: every snapshot posted under the incident, the node leaders' values
    first (waiting up to wait_s for those of `leaders` that posted a snapshot themselves: a
    dead leader posts nothing), then the ranks none of them brought. `ahead`: the values read
    while the snapshots came in (not read again). `stats` gets how many came each way
    (node_values, from_node_leaders, one_by_one)."""
    ex, key = incident.ex, incident.keys.snap
    reader = ahead if ahead is not None else NodeReader(incident, cache)
    live = ex.present(key, leaders) if leaders else []
    _read_as_they_come(reader, live, time.monotonic() + wait_s)
    todo = [r for r in live if r not in reader.leaders]
    # The leaders' keys only: found among all N ranks, 2047 of 16384 present cost 32k checks.
    reader.leaders.update(todo)
    reader.absorb((ex.collect(incident.keys.node, todo) if todo else {}).values())
    snaps = dict(reader.snaps)
    brought = len(snaps)
    rest = [r for r in range(incident.world) if r not in snaps]
    if rest:
        snaps.update(collect_snapshots(ex, key, rest, cache=cache))
    if stats is not None:
        stats.update(node_values=len(live), from_node_leaders=brought, one_by_one=len(snaps) - brought)
    return snaps
