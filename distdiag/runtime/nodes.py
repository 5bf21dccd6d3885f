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

__all__ = ["AGGREGATE_WAIT_S", "node_members", "node_leaders", "aggregate_node", "gather_snapshots"]

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
            ex.store.add(f"{incident.keys.node}/n", 1)
    except Exception as exc:  # noqa: BLE001 - the writer reads this node's snapshots one by one then
        log.debug("could not post the node's snapshots: %s", exc)
        return 0
    return len(have)


def gather_snapshots(incident: Incident, *, cache: dict[str, str], leaders: list[int],
                     wait_s: float = AGGREGATE_WAIT_S, stats: dict[str, int] | None = None) -> dict[int, dict[str, Any]]:
    """The writer's part: every snapshot posted under the incident, the node leaders' values
    first (waiting up to wait_s for those of `leaders` that posted a snapshot themselves: a
    dead leader posts nothing), then the ranks none of them brought. `stats` gets how many
    came each way (node_values, from_node_leaders, one_by_one)."""
    ex, key = incident.ex, incident.keys.snap
    live = ex.present(key, leaders) if leaders else []
    if live:
        ex.wait_count(incident.keys.node, len(live), time.monotonic() + wait_s, poll_s=POLL_S)
    snaps: dict[int, dict[str, Any]] = {}
    # The leaders' keys only: found among all N ranks, 2047 of 16384 present cost 32k checks.
    for value in (ex.collect(incident.keys.node, live) if live else {}).values():
        try:
            node = snapwire.unpack_many(value, cache)
        except Exception as exc:  # noqa: BLE001 - a corrupt value: its ranks are read one by one below
            log.debug("a node's snapshots could not be unpacked: %s", exc)
            continue
        for rank, snap in node.items():
            if 0 <= rank < incident.world:
                snaps.setdefault(rank, snap)
    brought = len(snaps)
    rest = [r for r in range(incident.world) if r not in snaps]
    if rest:
        snaps.update(collect_snapshots(ex, key, rest, cache=cache))
    if stats is not None:
        stats.update(node_values=len(live), from_node_leaders=brought, one_by_one=len(snaps) - brought)
    return snaps
