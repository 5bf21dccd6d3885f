"""Each rank's last snapshot, read into one shape the rules can compare: where it waits.

A snapshot comes from the check's tracker (distdiag.runtime.tracker) or the watchdog
(distdiag.watchdog.progress). Two sources say which collective a rank is inside:

- the engine (torch's flight recorder, distdiag.hang.recorder): per process group, the last
  collective enqueued and completed - whoever issued it (DDP's reducer, FSDP, a compiled
  graph, DCP, NCCL kernels queued ahead). Its sequence numbers count every collective, so
  they compare across ranks;
- the Python wrapper (distdiag.runtime.comm / watchdog.intercept): the call site and the user's
  step, for the calls it wraps.

When a rank's engine view is usable it decides what the rank waits in, and the wrapper adds
the call site when both name the same group; otherwise the wrapper's record is all there is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from distdiag.hang.groupid import group_members, parse_label
from distdiag.hang.recorder import pending_groups
from distdiag.hang.records import Cause, RankSnapshot
from distdiag.report.render import compress_numbers, format_ranks

__all__ = [
    "RankView", "build_views", "rank_state", "coll_label", "where", "stack_text", "state_rows",
    "snapshot_details", "group_members", "wait_text", "recent_table", "SplitRecords", "RECENT_COLUMNS",
    "frame_fields", "culprit_locations",
]

_OWN = "/distdiag/"
_JOB_WORK = ("/distdiag/probes/", "/distdiag/workloads/", "/distdiag/runtime/comm.py", "/distdiag/runtime/faults.py")
"""distdiag's code that does the job's work (the check's probes, their collectives and injected
faults): where a rank is, as any job's line. Every other frame of distdiag's own package is its
runner or its watchdog, never where a rank is stuck; nor is runpy's `-m` launch."""


def _runner(path: str) -> bool:
    """A frame of distdiag's runner (or runpy's), not of the job."""
    return ((_OWN in path and not any(w in path for w in _JOB_WORK)) or path.endswith("/runpy.py")
            or path.startswith("<frozen runpy>"))
_TORCH = re.compile(r"/(site|dist)-packages/torch/|/torch/(distributed|nn|autograd|_dynamo|_functorch|_inductor|utils|optim|_tensor\.py|_ops\.py)")
_C10D = "/torch/distributed/distributed_c10d.py"
_LIBS = re.compile(
    r"/(site|dist)-packages/(accelerate|lightning|pytorch_lightning|lightning_fabric|transformers|deepspeed|"
    r"datasets|torchdata|torchtnt|peft|trl|composer|megatron)/"
)
"""Training libraries: a frame in them is where a rank is, not the job's own line that led there
(accelerate's `state.py: wait_for_everyone` is called from the user's script)."""
_PACKAGES = re.compile(r"/(site|dist)-packages/")
"""Any installed package: the job's own line is preferably outside them."""


def _path(line: str) -> str:
    return line.split(":", 1)[0]


def _innermost(stack: list[str] | tuple[str, ...]) -> str:
    for line in reversed(stack):
        path = _path(line)
        if not _runner(path) and "/threading.py" not in path:
            return line
    # only the runner's frames: the script's own are gone (it returned, or an exception is
    # unwinding it), which says more than runpy's line would
    return "(outside the script: only the launcher's frames are left)" if stack else "?"


STACK_CACHE = 4096
"""Distinct stacks whose reading (`where`, `user_frame`, `issued_via`) is kept: the ranks of a
job share a few stacks (the 16k ranks of benchmarks/bench_scale.py have 4), and each reading is a
walk with regular expressions over every frame (0.15 s for 16k ranks, done 3 times)."""


def where(stack: list[str]) -> str:
    """The innermost frame of the stack that is not distdiag's own runner, and the job's own
    line that led there when that frame is in torch or a training library."""
    return _by_stack(_where, stack)


def _by_stack(reading: Any, stack: list[Any]) -> Any:
    """reading(stack), kept per distinct stack (a stack with an unhashable frame: not kept)."""
    key = tuple(stack)
    try:
        return reading(key)
    except TypeError:
        return reading.__wrapped__(key)


@lru_cache(maxsize=STACK_CACHE)
def _where(stack: tuple[str, ...]) -> str:
    inner = _innermost(stack)
    mine = _user_frame(stack)
    return inner if mine is None or mine == inner else f"{inner} (called from {mine})"


def with_user_site(site: str, stack: list[str]) -> str:
    """A call site in a library (accelerate's wait_for_everyone), with the job's line that called it."""
    if not _in_library(site):
        return site
    mine = user_frame(stack)
    return site if mine is None or mine == site else f"{mine} (through {site})"


@lru_cache(maxsize=STACK_CACHE)
def _in_library(site: str) -> bool:
    return bool(_PACKAGES.search(_path(site)) or _TORCH.search(_path(site)))


def user_frame(stack: list[str]) -> str | None:
    """The innermost frame outside torch and distdiag's runner: the line of the job that led here."""
    return _by_stack(_user_frame, stack)


@lru_cache(maxsize=STACK_CACHE)
def _user_frame(stack: tuple[str, ...]) -> str | None:
    """First a frame outside every installed package (the job's own file: Lightning's self.log
    reaches the collective through torchmetrics, a package of no list), else outside the
    training libraries (a job installed as a package itself)."""
    found = None
    for line in reversed(stack):
        path = _path(line)
        if _TORCH.search(path) or _runner(path) or "/threading.py" in path:
            continue
        if path.startswith("<eval_with_key"):  # an FX graph's generated code: its caller is the job's line
            continue
        if _LIBS.search(path):
            continue
        if not _PACKAGES.search(path):
            return line
        found = found or line
    return found


def issued_via(stack: list[str]) -> str:
    """How torch came to issue the collective a rank waits in, from its main-thread stack:
    the torch.distributed API called (`scatter_object_list`), or `backward()` (DDP's and
    FSDP's gradient hooks run inside it), or a compiled graph."""
    return _by_stack(_issued_via, stack)


@lru_cache(maxsize=STACK_CACHE)
def _issued_via(stack: tuple[str, ...]) -> str:
    api = None
    for line in stack:  # outermost first: the API the job (or a library) called
        if _C10D in _path(line):
            api = line.split(" in ", 1)[1].split(":", 1)[0] if " in " in line else None
            break
    text = " ".join(stack)
    if api:
        return api
    if "backward" in text and ("/torch/autograd/" in text or "/torch/_tensor.py" in text):
        return "backward() (DDP's or FSDP's gradient hooks)"
    if "/torch/_dynamo/" in text or "/torch/_inductor/" in text or "compiled" in text:
        return "a compiled graph"
    if "/torch/distributed/fsdp/" in text:
        return "FSDP"
    return ""


def stack_text(snap: dict[str, Any], limit: int = 8) -> str:
    return "\n".join((snap.get("stack") or [])[-limit:])


def rank_state(rec: RankSnapshot) -> str:
    """collective | finished | final | setup | computing: what the rank was doing."""
    if rec.waiting:
        return "collective"
    return {"barrier": "finished", "final": "final", "setup": "setup", "checkin": "setup"}.get(rec.phase, "computing")


def coll_label(c: dict[str, Any]) -> str:
    """'all_reduce #3 on world (float32[4])'; a collective without a tensor (a barrier) has no
    parenthesis: 'barrier #1 on world'."""
    return f"{c['op']} #{c['seq']} on {short_group(str(c['group']))}{tensor_text(c)}"


def tensor_text(c: dict[str, Any]) -> str:
    """' (float32[4])' for a collective's tensor; '' where it has none the records tell (a barrier:
    the tracker writes dtype 'none', torch's recorder no sizes), never '(?None)'."""
    shape = c.get("shape")
    dims = "x".join(str(s) for s in shape) if isinstance(shape, list | tuple) else ""
    dtype = c.get("dtype")
    if not dims and dtype in (None, "none", "?", ""):
        return ""
    return f" ({dtype or '?'}[{dims or '-'}])"


LONG_GROUP = 16
"""Groups with more members than this are named by their compressed member set in reports."""


@lru_cache(maxsize=1 << 16)  # a label per group: 16k ranks of TP=8 x PP=4 have 6k (4096 thrashed)
def short_group(label: str) -> str:
    """'ranks[3,35,67,...]' of a large group as 'ranks[3-16355 step 32] (512 ranks)': a data-parallel
    group at 16k ranks is 3 KB of digits otherwise. Small groups keep their label as is."""
    if not label.startswith("ranks[") or label.count(",") < LONG_GROUP:
        return label
    members = parse_label(label).members
    if members is None:
        return label
    return f"ranks[{compress_numbers(members)}] ({len(members)} ranks)"


def wait_text(w: dict[str, Any]) -> str:
    """'all_reduce #3 on world (float32[4]) via backward()': the collective and how torch issued it."""
    via = w.get("via") or ""
    how = f" via {via}" if via and not str(w.get("op", "")).startswith(via) else ""
    return f"{coll_label(w)}{how}"


@dataclass
class RankView:
    """What the rules need of one live rank."""

    rank: int
    snap: dict[str, Any]
    """The snapshot as posted (the details and the text read it)."""
    record: RankSnapshot
    """The same, typed: what the rules decide on."""
    state: str
    waits: list[dict[str, Any]] = field(default_factory=list)
    """The collectives it is inside, oldest first: group, seq, op, shape, dtype, for_s,
    call_site, via, source (engine | wrapper), started."""
    positions: dict[str, int] = field(default_factory=dict)
    """Group -> last collective enqueued (engine), when the engine view is usable."""
    engine_ok: bool = False
    steps: int | None = None
    """Optimizer steps taken (or the user's step marks), when known."""
    in_loop: bool | None = None
    """Whether the rank is still inside its training loop's frame (watchdog; None: unknown)."""

    @property
    def waiting(self) -> bool:
        return bool(self.waits)

    def wait_on(self, group: str) -> dict[str, Any] | None:
        return next((w for w in self.waits if w["group"] == group), None)


def _engine_waits(snap: dict[str, Any], stack: list[str]) -> list[dict[str, Any]]:
    wrapper = snap.get("in_collective") or None
    via = issued_via(stack)
    site = user_frame(stack)
    out = []
    for g in pending_groups(snap.get("engine")):
        p = g["pending"]
        w = {
            "group": g["group"], "seq": p["seq"], "op": p.get("op") or "?", "shape": p.get("shape"),
            "dtype": p.get("dtype", "?"), "for_s": p.get("for_s") or 0.0, "call_site": p.get("call_site") or site or "?",
            "via": via,
            "source": "engine", "started": g.get("started"), "completed": g.get("completed"),
            # What ranks compare: the engine's own op/sizes/dtype, the same on every rank whether
            # or not a wrapper also saw the call.
            # (A dump's send/recv gives its own key: the two sides differ by nature.)
            "key": tuple(p.get("key") or (p.get("op") or "?", str(p.get("shape")), p.get("dtype", "?"))),
        }
        if wrapper and wrapper.get("group") == g["group"]:
            # The same collective as the user called it (the engine may name the backend's op:
            # gloo records reduce_scatter as all_reduce), with its call site.
            w.update(op=wrapper.get("op", w["op"]), shape=wrapper.get("shape", w["shape"]),
                     dtype=wrapper.get("dtype", w["dtype"]), call_site=wrapper.get("call_site", w["call_site"]))
            # The recorder does not keep a broadcast's root or a reduction's op: what the
            # wrapper saw ("broadcast(src=1)") tells same-shape calls apart.
            w["key"] = (*w["key"], wrapper.get("op"))
        out.append(w)
    return out


def _wrapper_wait(snap: dict[str, Any]) -> dict[str, Any] | None:
    c = snap.get("in_collective")
    if not c:
        return None
    w = dict(c)
    w.setdefault("for_s", 0.0)
    w.update(source="wrapper", via=w.get("via", ""), key=(w.get("op"), str(w.get("shape")), w.get("dtype")))
    return w


def build_views(
    snaps: dict[int, dict[str, Any]], lost: Mapping[int, str], records: dict[int, RankSnapshot] | None = None,
) -> dict[int, RankView]:
    """A RankView for every live rank (not in `lost`). `records`: the same snapshots typed
    (RankSnapshot.from_dict of each), when the caller typed them already (the watchdog's
    writer types each once per incident: ~0.15 s a pass at 16k ranks)."""
    views: dict[int, RankView] = {}
    for rank, snap in snaps.items():
        if rank in lost:
            continue
        rec = records[rank] if records is not None and rank in records else RankSnapshot.from_dict(snap)
        stack = rec.stack
        view = RankView(rank=rank, snap=snap, record=rec, state=rank_state(rec),
                        engine_ok=rec.engine is not None and rec.engine.ok)
        if rec.engine is not None and view.engine_ok:
            # Which collective the rank is inside, per group, is the recorder's (on NCCL its
            # oldest open op, recorder._inside_seq): the training thread waits at a later
            # synchronisation there, not inside the call its stack shows. The wait-for graph
            # (hang/waitfor.py) decides who never entered it with the frontier's rule the dumps
            # use (hang/frontcore.py).
            view.positions = {g.group: g.enqueued for g in rec.engine.groups}
            view.waits = _engine_waits(snap, stack)
            wrapper = _wrapper_wait(snap)
            # A wrapped call on a group the engine does not track (p2p, a group with no
            # collective recorded yet) still says where the rank waits.
            if wrapper and not view.waits and wrapper.get("group") not in view.positions:
                view.waits = [wrapper]
        else:
            # The recorder is off or unreadable: the Python wrapper's record (the call the
            # stack is inside) is all there is, a fallback that sees only the calls it wraps.
            wrapper = _wrapper_wait(snap)
            view.waits = [wrapper] if wrapper else []
        for w in view.waits:
            if w.get("call_site"):
                w["call_site"] = with_user_site(str(w["call_site"]), stack)
        view.steps = rec.steps if isinstance(rec.steps, int) else None
        view.in_loop = rec.in_loop
        views[rank] = view
    return views


def state_rows(
    snaps: dict[int, dict[str, Any]], lost: Mapping[int, str], world: int, infos: dict[int, Any] | None = None,
    views: dict[int, RankView] | None = None,
) -> list[dict[str, Any]]:
    """One row per rank for the report's table: state and where. `infos` (rank -> an object
    with `host` and `pid`, RankInfo) gives a lost rank's host and pid where they are known
    (its check-in, its note to the launcher); '?' only where nothing is. `views`: the rules'
    build_views(snaps, lost), when built already (the rows read the ranks not in `lost`)."""
    views = build_views(snaps, lost) if views is None else views
    rows = []
    for rank in range(world):
        if rank in snaps and rank not in lost:
            s, v = snaps[rank], views[rank]
            if v.waits:
                w = v.waits[0]
                how = f" via {w['via']}" if w.get("via") else ""
                what = f"in {coll_label(w)} for {float(w.get('for_s') or 0):.1f}s{how}, called at {w.get('call_site', '?')}"
            elif v.state == "finished":
                what = f"finished '{s.get('probe') or s.get('where')}' after {s.get('collectives_in_probe', 0)} collectives, waiting for the others"
            else:
                what = f"{v.state} in '{s.get('where') or s.get('probe') or s.get('phase')}' for {s.get('phase_for_s', 0):.1f}s at {where(s.get('stack', []))}"
            rows.append({"rank": rank, "host": s.get("host", "?"), "pid": s.get("pid", "?"), "state": v.state, "where": what})
        else:
            info = (infos or {}).get(rank)
            host = info.host if info is not None and info.host not in ("", "?") else "?"
            pid = info.pid if info is not None and info.pid > 0 else "?"
            rows.append({"rank": rank, "host": host, "pid": pid, "state": "lost", "where": lost.get(rank, "no answer")})
    return rows


def _namer(names: dict[str, str]) -> Callable[[str], str]:
    """A large group's short name for the report's details ('ranks[3-16355 step 32] (512 ranks)'),
    its full label kept once in `names`: a 512-member label repeated in every rank's records
    made the report grow with ranks x group size (44 MB at 4096 ranks)."""
    short_of: dict[str, str] = {}

    def name(label: str) -> str:
        short = short_of.get(label)
        if short is None:
            short = base = short_group(label)
            k = 1
            while short != label and names.get(short, label) != label:  # two sets that compress alike
                k += 1
                short = f"{base} #{k}"
            if short != label:
                names[short] = label
            short_of[label] = short
        return short

    return name


def snapshot_details(snaps: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Per-rank stacks, recent collectives and engine positions for a hang result's details.
    Large groups go by their short names; `group_members` maps each to its full label."""
    names: dict[str, str] = {}
    nm = _namer(names)
    grouped = len(snaps) > GROUPED_DETAILS_RANKS
    details: dict[str, Any] = {}
    if grouped:
        details["details_note"] = (
            f"{len(snaps)} ranks: the stacks are grouped by identical stack (`stacks_grouped`); each "
            "rank's position on each group is in the flight recorder's table")
        details["stacks_grouped"] = _grouped({r: s.get("stack") or [] for r, s in snaps.items()})
    else:
        details["stacks"] = {str(r): s.get("stack", []) for r, s in sorted(snaps.items())}
    if grouped:
        details["recent_collectives_table"] = recent_table(snaps, nm)
    else:
        details["recent_collectives"] = {str(r): [{**c, "group": nm(str(c.get("group")))} for c in s.get("recent", [])]
                                         for r, s in sorted(snaps.items())}
    engine = {str(r): s["engine"] for r, s in sorted(snaps.items()) if s.get("engine")}
    if engine:
        if not grouped:
            details["engine"] = {r: {k: ([{**g, "group": nm(str(g.get("group")))} for g in v] if k == "groups" else v)
                                     for k, v in e.items() if k != "entries"} for r, e in engine.items()}
        rows = _positions_by_group(engine, nm) if grouped else [
            {"rank": int(r), **_position(g, nm)} for r, e in engine.items() for g in e.get("groups", [])
        ]
        if rows:
            details["table:collectives per group (torch's flight recorder)"] = rows
        states = {e.get("state") for e in engine.values()}
        if states != {"ok"}:
            reasons = sorted({e.get("reason", "") for e in engine.values() if e.get("state") != "ok"})
            details["engine_note"] = "; ".join(r for r in reasons if r)
    if names:
        details["group_members"] = names
    return details


def _position(g: dict[str, Any], nm: Callable[[str], str]) -> dict[str, Any]:
    """A rank's position on one group, as the flight recorder's table shows it."""
    return {"group": nm(str(g["group"])), "enqueued": _count(g["enqueued"]), "completed": _count(g["completed"]),
            "started": "-" if g.get("started") is None else g["started"],
            "inside": coll_label({**g["pending"], "group": g["group"]}) if g.get("pending") else "-"}


def _count(n: Any) -> Any:
    """A position as the table shows it: torch's recorder starts its counters at -1 (nothing yet)."""
    return "none" if isinstance(n, int) and n < 0 else n


def _positions_by_group(engine: dict[str, Any], nm: Callable[[str], str]) -> list[dict[str, Any]]:
    """The flight recorder's table past GROUPED_DETAILS_RANKS: one row per group and position,
    with the ranks there (`ranks`: exactly them, in short; `count`). The groups whose members
    disagree come first, the fewest ranks of a group first: rank 3 at #5 where its 7 peers
    wait in #6 is the first row, not one of 65k (16k ranks x 4 groups). Two groups of the same
    members (a gloo twin of an NCCL group) are told apart by their order on each rank (every
    rank creates its groups in one order) and named so."""
    ranks_at: dict[Any, dict[tuple[Any, ...], tuple[dict[str, Any], list[int]]]] = {}
    for r, e in engine.items():
        rank = int(r)
        again: dict[Any, int] = {}  # labels met before on this rank: the how-manieth group of those members
        for g in e.get("groups", []):
            label = g["group"] if type(g["group"]) is str else str(g["group"])
            n = again[label] = again.get(label, -1) + 1
            p = g.get("pending") or None
            key = (g["enqueued"], g["completed"], g.get("started"),
                   *((p.get("op"), p.get("seq"), str(p.get("shape")), p.get("dtype")) if type(p) is dict else (p,)))
            at = ranks_at.setdefault((label, n) if n else label, {})
            try:
                at.setdefault(key, (g, []))[1].append(rank)
            except TypeError:  # a field no JSON scalar (a corrupt snapshot): by its text
                at.setdefault(tuple(map(str, key)), (g, []))[1].append(rank)
    out: list[tuple[bool, int, int, dict[str, Any]]] = []
    for order, (group, at) in enumerate(ranks_at.items()):
        for g, ranks in at.values():
            fields = _position(g, nm)
            name = fields.pop("group")
            if type(group) is tuple:
                name = f"{name} (group {group[1] + 1} of these ranks)"
            row = {"group": name, "ranks": compress_numbers(ranks, cut=False), "count": len(ranks), **fields}
            out.append((len(at) == 1, order, len(ranks), row))
    out.sort(key=lambda t: t[:3])
    return [row for *_, row in out]


GROUPED_DETAILS_RANKS = 1024
"""Past this many ranks a hang report's stacks are written once per distinct stack with the
ranks that share it (4.7 MB at 16k ranks, 0.1 MB grouped), the per-rank engine view, which
repeats the recorder's table (11 MB), is left out, and each rank's recent collectives are
written as rows that point at the fields they share (`recent_table`: 35 MB -> 7 MB)."""

RECENT_COLUMNS = ("group", "seq", "step", "duration_s")
"""The fields of a recent collective that differ between ranks and calls; the others (op,
shape, dtype, call site, fingerprint, ...) are what many records share."""


class SplitRecords(list):  # type: ignore[type-arg]
    """A rank's recent collectives as a node leader posted them (distdiag/runtime/snapwire.py
    `pack_many`): each record's shared fields once per node, so `at[i]` is the index of record
    i's in `shared`, where the RECENT_COLUMNS hold None (a column the record lacks is no key).
    A list like any other; `recent_table` reads the split and need not find the shared
    fields again (131k records at 16k ranks: 0.3 s). A changed list is a plain list; a record
    changed in place is not seen (recent_table would show its node's fields), and the records'
    nested values (a shape's list) are shared by the node's ranks: read them, copy to edit."""

    __slots__ = ("shared", "at")

    def __init__(self, records: list[dict[str, Any]], shared: list[dict[str, Any]], at: list[int]) -> None:
        super().__init__(records)
        self.shared = shared
        self.at = at


class _SharedFields:
    """The distinct sets of a record's shared fields, each once, by index in first-seen order."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._index: dict[Any, list[int]] = {}

    def at(self, rest: dict[str, Any]) -> int:
        # a cheap first key, then equality: repr() of 131k records was 0.1 s at 16k ranks
        known = self._index.setdefault((rest.get("fp"), rest.get("op"), rest.get("call_site"), len(rest)), [])
        for at in known:
            if self.items[at] == rest:
                return at
        known.append(len(self.items))
        self.items.append(rest)
        return known[-1]


def _rest(record: dict[str, Any]) -> dict[str, Any]:
    """A record without its RECENT_COLUMNS."""
    rest = record.copy()
    for k in RECENT_COLUMNS:
        rest.pop(k, None)
    return rest


def recent_table(snaps: dict[int, dict[str, Any]], name: Callable[[str], str]) -> dict[str, Any]:
    """Every rank's recent collectives, lossless and compact: `shared` holds each distinct set of
    the other fields once, and each record is a row [the index of its shared fields, then its
    RECENT_COLUMNS values] (null: the record has no such field), in each rank's order.
    `name`: a group's short name (its full label is in `group_members`). Records a node leader
    split (SplitRecords) are matched by their node's shared fields, once for the node. Anything
    in a rank's list that is no record (a corrupt snapshot) is left out."""
    fields = _SharedFields()
    by_node: dict[tuple[int, int], int] = {}  # (id of a node's shared list, index there) -> index in fields
    by_rank: dict[str, list[list[Any]]] = {}
    short: dict[str, str] = {}  # name() of each group met so far (a dict read, not a call, a record)
    for rank, snap in sorted(snaps.items()):
        rows = by_rank[str(rank)] = []
        records: Any = snap.get("recent") or []  # a list, or a node leader's SplitRecords
        split = records.at if type(records) is SplitRecords and len(records.at) == len(records) else None
        for i, c in enumerate(records):
            if type(c) is not dict:
                continue
            if split is None:
                at: int | None = fields.at(_rest(c))
            else:
                key = (id(records.shared), split[i])
                at = by_node.get(key)
                if at is None:
                    at = by_node[key] = fields.at(_rest(records.shared[split[i]]))
            group = c.get("group")
            if type(group) is str:
                group = short.get(group) or short.setdefault(group, name(group))
            elif group is not None:
                group = name(str(group))
            rows.append([at, group, c.get("seq"), c.get("step"), c.get("duration_s")])
    return {"columns": ["shared", *RECENT_COLUMNS], "shared": fields.items, "by_rank": by_rank}


def _grouped(by_rank: dict[int, Any]) -> list[dict[str, Any]]:
    """[{ranks (all of them), about (the ranks in short), count, value}] for each distinct value,
    the most shared first."""
    ranks_of: dict[Any, list[int]] = {}
    value_of: dict[Any, Any] = {}
    for rank, value in sorted(by_rank.items()):
        # a stack (a list of lines) by its lines; anything else by its JSON (16k json.dumps: 0.05 s)
        key = tuple(value) if type(value) is list and all(type(x) is str for x in value) else (
            json.dumps(value, sort_keys=True, default=str))
        ranks_of.setdefault(key, []).append(rank)
        value_of.setdefault(key, value)
    order = sorted(ranks_of, key=lambda k: (-len(ranks_of[k]), ranks_of[k][0]))
    return [{"ranks": ranks_of[k], "about": format_ranks(ranks_of[k]), "count": len(ranks_of[k]), "value": value_of[k]}
            for k in order]


def describe_ranks(ranks: list[int]) -> str:
    return format_ranks(sorted(ranks))


_FRAME = re.compile(r"^(?P<file>.+?):(?P<line>\d+) in (?P<function>[^:]+?)(?:: (?P<code>.*))?$")
LOCATED_RANKS = 64
"""A finding naming more ranks than this gets no per-rank locations (its sentences name none)."""


def frame_fields(line: str) -> dict[str, Any] | None:
    """'/job/data.py:58 in next_batch: return next(it)' -> {"file", "line", "function", "code"}."""
    m = _FRAME.match(line.strip())
    if m is None:
        return None
    return {"file": m.group("file"), "line": int(m.group("line")), "function": m.group("function").strip(),
            "code": (m.group("code") or "").strip()}


def culprit_locations(findings: list[Any], views: dict[int, RankView]) -> list[dict[str, Any]]:
    """Where the blamed ranks are, as fields, for each place a finding's sentences name
    (`path:line`): {"finding": its index, "rank", "file", "line", "function", "code"}, from the
    rank's innermost frame and the job's own line that led there, those the issue or evidence
    names. Ranks waiting on others are never located (a stranded finding names no culprit)."""
    out: list[dict[str, Any]] = []
    for i, f in enumerate(findings):
        if not f.ranks or len(f.ranks) > LOCATED_RANKS or f.cause == Cause.STRANDED:
            continue
        text = f"{f.issue}\n{f.evidence}"
        for r in f.ranks:
            v = views.get(r)
            stack = [str(x) for x in v.record.stack or []] if v is not None else []
            seen = set()
            for frame in (_innermost(stack), user_frame(stack)) if stack else ():
                fields = frame_fields(frame) if frame else None
                if fields is None or (fields["file"], fields["line"]) in seen:
                    continue
                if f"{fields['file']}:{fields['line']}" in text:
                    seen.add((fields["file"], fields["line"]))
                    out.append({"finding": i, "rank": r, **fields})
    return out
