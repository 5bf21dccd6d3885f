"""Flight-recorder dumps turned into groups known by their members, the same on every rank.

In torch's dumps a process group appears three ways, none of them global on its own:
`pg_id` is a per-process counter (the same id names different communicators on different
ranks), entries carry `process_group` = (name, desc) and `pg_id`, `pg_config` is keyed by
group name with the members as a string ("[0, 2]"), and `pg_status` (last enqueued /
started / completed) is keyed by `pg_id`. So: entries map pg_id -> name on each rank,
pg_config maps name -> members, and a group is identified everywhere by its members (a
tuple of global ranks) and desc. Where pg_config gives no members (gloo on torch 2.13
writes none), the members of a group name are the ranks whose dumps recorded it
(`infer_members`): a member that never recorded anything on that group is then not seen.

For each rank and group: every recorded op (op, seq, state, sizes, dtypes, peer for
send/recv), and the position (last enqueued / started / completed) by the sequence the
group uses: `collective_seq_id` for collectives, `p2p_seq_id` for a group that only did
send/recv (its pg_status counts that sequence). A rank that recorded no entries keeps its
groups from pg_config with no known position (pg_status cannot be mapped without entries).

`GroupState` per (rank, GroupState.key = members, desc, and torch's group name only where two
groups share members and desc) is the interface the hang rules read (`engine_view` turns
it into the engine view hang/rules.py reads today). Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from distdiag.hang.dumps import as_int
from distdiag.hang.groupid import GroupId

__all__ = ["OpRecord", "GroupState", "RankDump", "normalise", "infer_members", "world_of", "group_label", "engine_view", "op_text"]

Members = tuple[int, ...]
_P2P_OPS = ("send", "recv")
_WRAPPER_FILES = ("typing_extensions.py", "functools.py", "contextlib.py", "warnings.py")
"""Decorators between torch's collective and its caller (typing_extensions.deprecated wraps
all_gather_into_tensor on torch 2.13)."""
_PEER = re.compile(r"^(\d+)\s*(->|<-)\s*(\d+)$")


@dataclass
class OpRecord:
    """One recorded op of one rank on one group."""

    op: str
    seq: int
    """collective_seq_id, or p2p_seq_id for send/recv."""
    state: str
    sizes: list[list[int]] | None
    dtypes: list[str] | None
    p2p: bool = False
    peer: int | None = None
    """The other global rank of a send/recv (from 'send a->b' / 'recv a<-b', group-local)."""
    local_peer: int | None = None
    backend: str = "?"
    created_ns: int = 0
    frames: list[str] = field(default_factory=list)
    """'function (file:line)' of the Python caller, innermost first, torch's own frames left out."""
    order: int = 0
    """Where the rank recorded it: `record_id` (per process), else its place in the dump."""
    coll_seq: int = 0
    """collective_seq_id as recorded (a coalesced batch of send/recv shares its group's number)."""
    done: bool = False
    """Its completion was discovered: state 'completed', or `retired` (gloo never says 'completed')
    unless the state says 'started'."""
    out_sizes: list[list[int]] | None = None


@dataclass
class GroupState:
    """One rank's view of one process group."""

    members: Members | None
    """Global ranks, sorted; None while unknown (resolved by infer_members)."""
    name: str
    desc: str
    ops: list[OpRecord] = field(default_factory=list)
    p2p_only: bool = False
    enqueued: int | None = None
    """Last sequence number enqueued (None: unknown, e.g. a rank that recorded no entries)."""
    started: int | None = None
    completed: int | None = None
    position_from: str = "entries"
    """'pg_status' or 'entries' (gloo: completion then unknown; see completion_unknown)."""
    completion_unknown: bool = False
    members_inferred: bool = False
    twin: bool = False
    """Another group has the same members and desc (e.g. a P2P group beside a tp group of the
    same ranks): its label then carries torch's group name too, which is the same on every rank."""

    @property
    def key(self) -> tuple[Members, str, str]:
        """(members, desc, name when needed to tell twins apart): the same on every rank."""
        return (self.members or (), self.desc, self.name if self.twin else "")

    def gid(self, world: int) -> GroupId:
        """The group as reports name it: members, desc, and the name where it has a twin."""
        return _gid(self.members or (), world, self.desc, self.name if self.twin else "")

    @property
    def last(self) -> OpRecord | None:
        return next((o for o in reversed(self.ops) if o.seq == self.enqueued), self.ops[-1] if self.ops else None)

    def as_dict(self) -> dict[str, Any]:
        """{op, seq, state, sizes, dtypes, peer} of the last op, plus the position."""
        last = self.last
        return {
            "members": list(self.members or ()), "name": self.name, "desc": self.desc, "p2p": self.p2p_only,
            "enqueued": self.enqueued, "started": self.started, "completed": self.completed,
            "op": last.op if last else None, "seq": last.seq if last else None, "state": last.state if last else None,
            "sizes": last.sizes if last else None, "dtypes": last.dtypes if last else None,
            "peer": last.peer if last else None,
        }


@dataclass
class RankDump:
    """One rank's dump, normalised."""

    rank: int
    version: str
    comm_lib_version: str
    groups: dict[str, GroupState]
    """By group name while reading; `by_key` gives the global view."""
    notes: list[str] = field(default_factory=list)
    empty: bool = False

    def by_key(self) -> dict[tuple[Members, str, str], GroupState]:
        """Groups keyed by GroupState.key: members first, never a per-process id."""
        return {g.key: g for g in self.groups.values() if g.members is not None}


def _parse_members(raw: Any) -> Members | None:
    if isinstance(raw, str):
        return _members_of(raw)
    values = [v for v in (as_int(x) for x in raw) if v is not None] if isinstance(raw, list | tuple) else []
    return tuple(sorted(set(values))) if values and min(values) >= 0 else None


@lru_cache(maxsize=4096)
def _members_of(raw: str) -> Members | None:
    """Members from pg_config's string, parsed once per string: every rank's dump lists the
    world group's (and its other groups') members again."""
    found = re.findall(r"-?\d+", raw)
    values = [int(x) for x in found] if len(found) <= 1 << 20 else []
    return tuple(sorted(set(values))) if values and min(values) >= 0 else None


def _frames(raw: Any) -> list[str]:
    out = []
    for f in raw if isinstance(raw, list | tuple) else []:
        if not isinstance(f, dict):
            continue
        filename = str(f.get("filename", "?"))
        path = filename.replace("\\", "/")
        if "/torch/" in path or path.rsplit("/", 1)[-1] in _WRAPPER_FILES:
            continue  # torch's own wrappers (all_reduce, c10d_logger.wrapper): the user's call is below
        out.append(f"{f.get('name', '?')} ({filename.rsplit('/', 1)[-1]}:{f.get('line', '?')})")
    return out[:8]


def _op_of(entry: dict[str, Any]) -> OpRecord:
    profiling = str(entry.get("profiling_name") or "?")
    backend, _, rest = profiling.partition(":") if ":" in profiling else ("?", "", profiling)
    op, _, meta = rest.strip().partition(" ")
    p2p = bool(entry.get("is_p2p")) or op in _P2P_OPS
    local_peer = None
    m = _PEER.match(meta.strip())
    if m and op in _P2P_OPS:  # 'send 0->1' (self -> peer), 'recv 1<-0' (self <- peer), group-local ranks
        local_peer = int(m.group(3))
    seq = as_int(entry.get("p2p_seq_id" if p2p else "collective_seq_id"))
    sizes = entry.get("input_sizes") if op != "recv" else entry.get("output_sizes")
    dtypes = entry.get("input_dtypes") if op != "recv" else entry.get("output_dtypes")
    return OpRecord(
        op=op or "?", seq=seq if seq is not None else 0, state=str(entry.get("state") or "?"),
        sizes=_shapes(sizes),
        dtypes=[str(d) for d in dtypes] if isinstance(dtypes, list | tuple) else None,
        p2p=p2p, local_peer=local_peer, backend=backend, created_ns=as_int(entry.get("time_created_ns")) or 0,
        frames=_frames(entry.get("frames")), order=as_int(entry.get("record_id")) or 0,
        coll_seq=as_int(entry.get("collective_seq_id")) or 0,
        # gloo leaves every entry 'scheduled' and marks completion by `retired`; an entry NCCL saw
        # start and not end ('started') is not done, whatever else it says
        done=entry.get("state") == "completed" or (entry.get("retired") is True and entry.get("state") != "started"),
        out_sizes=_shapes(entry.get("output_sizes")),
    )


def _shapes(raw: Any) -> list[list[int]] | None:
    return [[as_int(x) or 0 for x in s] for s in raw] if isinstance(raw, list | tuple) else None


def _config_groups(dump: dict[str, Any]) -> dict[str, GroupState]:
    groups: dict[str, GroupState] = {}
    config = dump.get("pg_config")
    for key, cfg in (config.items() if isinstance(config, dict) else ()):
        name = str(cfg.get("name", key))
        if not name:
            continue  # gloo's placeholder row {'': {'name': '', 'ranks': '[]'}}
        groups[name] = GroupState(members=_parse_members(cfg.get("ranks")), name=name, desc=str(cfg.get("desc") or ""))
    return groups


def _status_by_name(dump: dict[str, Any], pg_names: dict[str, set[str]]) -> dict[str, dict[str, Any]]:
    """pg_status rows keyed by group name, through the pg_id -> name pairs the entries carry."""
    status = dump.get("pg_status")
    out: dict[str, dict[str, Any]] = {}
    for pg_id, row in (status.items() if isinstance(status, dict) else ()):
        names = pg_names.get(str(pg_id), set())
        if len(names) == 1:
            out[next(iter(names))] = row
    return out


def _position(g: GroupState, row: dict[str, Any] | None, mixed: bool) -> None:
    """Last enqueued / started / completed of one group, by the sequence it uses."""
    if row is not None and not mixed:
        g.enqueued = as_int(row.get("last_enqueued_collective"))
        started = as_int(row.get("last_started_collective"))
        g.started = started if started is not None and started >= 0 else None
        g.completed = as_int(row.get("last_completed_collective"))
        g.position_from = "pg_status"
        return
    # Entries only (an old dump, or a group with collectives and send/recv, whose pg_status
    # counters follow both sequences): the group's own ops and their states.
    ops = [o for o in g.ops if o.p2p == g.p2p_only]
    if not ops:
        return
    last = max(o.seq for o in ops)
    informative = any(o.state in ("started", "completed") for o in ops)
    g.enqueued = last
    g.started = max((o.seq for o in ops if o.state in ("started", "completed")), default=None)
    # gloo leaves every entry 'scheduled': the last op a rank recorded is taken as the one it is in
    g.completed = max((o.seq for o in ops if o.state == "completed"), default=-1) if informative else last - 1
    g.completion_unknown = not informative


def normalise(rank: int, dump: dict[str, Any]) -> RankDump:
    """One rank's dump (already checked by hang.dumps.dump_problem) in its normal form."""
    groups = _config_groups(dump)
    pg_names: dict[str, set[str]] = {}
    entries = dump.get("entries") or []
    for i, entry in enumerate(entries):
        pg = entry.get("process_group")
        name = str(pg[0]) if isinstance(pg, list | tuple) and pg else str(entry.get("pg_id", "?"))
        desc = str(pg[1]) if isinstance(pg, list | tuple) and len(pg) > 1 else ""
        if entry.get("pg_id") is not None:
            pg_names.setdefault(str(entry.get("pg_id")), set()).add(name)
        g = groups.setdefault(name, GroupState(members=None, name=name, desc=desc))
        g.desc = g.desc or desc
        op = _op_of(entry)
        if entry.get("record_id") is None:
            op.order = i  # older dumps: the order they list entries in
        g.ops.append(op)
    status = _status_by_name(dump, pg_names)
    for g in groups.values():
        g.p2p_only = bool(g.ops) and all(o.p2p for o in g.ops)
        mixed = any(o.p2p for o in g.ops) and not g.p2p_only
        _position(g, status.get(g.name), mixed)
    version = str(dump.get("version", "?"))
    lib = dump.get("comm_lib_version", dump.get("nccl_version", ""))
    rd = RankDump(rank=rank, version=version, comm_lib_version=str(lib or ""), groups=groups, empty=not entries)
    if not entries:
        rd.notes.append(f"rank {rank} recorded no entries: its position on each group is unknown (pg_status is keyed "
                        "by a per-process id that only entries map to a group)")
    return rd


def world_of(dumps: dict[int, RankDump]) -> int:
    """The job's size: the highest rank any dump names (as writer or member), plus one."""
    top = max(dumps, default=-1)
    for d in dumps.values():
        for g in d.groups.values():
            if g.members:
                top = max(top, g.members[-1])
    return top + 1


def infer_members(dumps: dict[int, RankDump], world: int) -> list[str]:
    """Fill in members pg_config did not give (gloo): the default group is every rank, any
    other group name the ranks whose dumps recorded it. Then resolve send/recv peers.
    Returns notes on what was inferred."""
    recorded: dict[str, set[int]] = {}
    for rank, d in dumps.items():
        for g in d.groups.values():
            if g.ops:
                recorded.setdefault(g.name, set()).add(rank)
    inferred = []
    for d in dumps.values():
        for g in d.groups.values():
            if g.members is None:
                default = g.desc == "default_pg" or (g.name == "0" and g.desc in ("", "default_pg"))
                g.members = tuple(range(world)) if default else tuple(sorted(recorded.get(g.name, {d.rank})))
                g.members_inferred = True
                inferred.append(g.name)
            for o in g.ops:
                if o.local_peer is not None and o.local_peer < len(g.members):
                    o.peer = g.members[o.local_peer]
    _mark_twins(dumps)
    if not inferred:
        return []
    return ["the dumps carry no group membership (gloo writes none): each group's members are the ranks whose dumps "
            "recorded it, so a member that recorded nothing on a group is not counted in it"]


def _mark_twins(dumps: dict[int, RankDump]) -> None:
    names: dict[tuple[Members | None, str], set[str]] = {}
    for d in dumps.values():
        for g in d.groups.values():
            names.setdefault((g.members, g.desc), set()).add(g.name)
    for d in dumps.values():
        for g in d.groups.values():
            g.twin = len(names[(g.members, g.desc)]) > 1


def group_label(g: GroupState, world: int) -> str:
    """'world', or 'ranks[0,2]', with torch's desc when it is a name (e.g. 'ranks[0,2] (DP)')
    and its group name when it has a twin: `GroupId.label` (distdiag/hang/groupid.py)."""
    return g.gid(world).label


@lru_cache(maxsize=1 << 16)
def _gid(members: Members, world: int, desc: str, name: str) -> GroupId:
    """One GroupId per group, its label worked out once (every member's dump names it)."""
    return GroupId.of(members, world, desc, name)


def op_text(o: OpRecord) -> str:
    """'all_reduce', 'send to 3', 'recv from 0'."""
    if o.peer is not None:
        return f"{o.op} {'to' if o.op == 'send' else 'from'} {o.peer}"
    return o.op


def _compact(o: OpRecord, label: str) -> dict[str, Any]:
    return {"pg": label, "group": label, "seq": o.seq, "op": o.op, "backend": o.backend, "sizes": o.sizes,
            "dtypes": o.dtypes, "state": o.state, "p2p": o.p2p, "created_ns": o.created_ns}


def _pending(g: GroupState) -> dict[str, Any]:
    last = g.last if g.last is not None and g.last.seq == g.enqueued else None
    pending: dict[str, Any] = {"seq": g.enqueued, "op": "?", "shape": None, "dtype": "?", "for_s": None, "state": None}
    if last is not None:
        shape = last.sizes[0] if last.sizes else None
        dtype = str(last.dtypes[0]).lower() if last.dtypes else "?"
        pending.update(op=op_text(last), shape=shape, dtype=dtype, state=last.state)
        if last.frames:
            pending["call_site"] = last.frames[0]
        if last.p2p:
            # the two sides of a send/recv differ by nature: ranks compare the transfer, not the verb
            pending["key"] = ("p2p", str(shape), dtype)
    return pending


def engine_view(rd: RankDump, world: int) -> dict[str, Any]:
    """One rank's dump as the engine view hang/rules.py reads (recorder.EngineReader.read's
    form): per group its label, position and the op it is inside; entries of collectives."""
    groups: list[dict[str, Any]] = []
    entries: list[dict[str, Any]] = []
    for g in sorted(rd.groups.values(), key=lambda g: (len(g.members or ()), g.members or ())):
        if g.members is None:
            continue
        label = group_label(g, world)
        row: dict[str, Any] = {
            "pg": g.name, "group": label, "backend": "dump", "enqueued": -1 if g.enqueued is None else g.enqueued,
            "started": g.started, "completed": -1 if g.completed is None else g.completed, "pending": None,
            "members": list(g.members), "desc": g.desc, "p2p": g.p2p_only,
            # the last op as hang rules keyed by members read it: {op, seq, state, sizes, dtypes, peer}
            "last": {k: v for k, v in g.as_dict().items() if k in ("op", "seq", "state", "sizes", "dtypes", "peer")},
        }
        if g.completion_unknown:
            row["completion_unknown"] = True
        if g.enqueued is not None and row["enqueued"] > row["completed"]:
            row["pending"] = _pending(g)
        groups.append(row)
        # send/recv entries pair across ranks by peer, not by sequence number: the desync rule
        # compares entries at the same number, so it sees collectives only
        entries += [_compact(o, label) for o in g.ops if not o.p2p]
    entries.sort(key=lambda c: c["created_ns"])
    if not groups and not rd.empty:
        return {"state": "off", "reason": "the dump holds no process group", "groups": [], "entries": []}
    # a rank that recorded nothing is still read: no position on any group (behind everywhere)
    return {"state": "ok", "reason": "", "groups": groups, "entries": entries}
