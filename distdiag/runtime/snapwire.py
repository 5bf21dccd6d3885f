"""A rank's snapshot as the store carries it: group labels by reference, compressed (issue 21).

A process group is known by its members, so its label lists them: `ranks[0,32,64,...]`. A
data-parallel group of a 16k-rank job has 512 members (~3 KB), and a snapshot names its groups
in every record (its position on each group, the collective it waits in, its recent history):
40 KB a rank, 650 MB for the writer to read. On the wire instead:

- each long label is written once, in the snapshot's own table (`~labels`), as its members'
  arithmetic runs (`0+32x512`: 512 ranks from 0 every 32; a mesh slice is one run, a
  flattened submesh a few), and the records name it `ranks@K`;
- the JSON is compressed (zlib, level 1: records repeat their op, shape and call site);
- the long history goes under its own key (`history_key`): the writer reads it where the
  analysis needs it, not 16k of them for every hang;
- a node leader's value (`pack_many`, a node's snapshots) writes the fields its ranks' recent
  collectives share (op, shape, dtype, call site: all but `RECENT_COLUMNS`) once for the node,
  each record as a row of its own values: 57 MB of JSON for the writer to parse at 16k ranks
  became 33 MB, and the report's table of recent collectives starts from the split
  (`SplitRecords`) instead of finding the shared fields again in 131k records.

`unpack` restores the labels in the same fields (one string per distinct label for the whole
gather: `cache`), so the analysis sees the snapshot it always saw. Values are JSON text inside
zlib: no pickle. A value without the magic prefix is plain JSON (a rank of an older version).
"""

from __future__ import annotations

import json
import re
import zlib
from typing import Any

from distdiag.hang.groupid import members_label, parse_label
from distdiag.hang.members import decode_members, encode_members
from distdiag.hang.views import RECENT_COLUMNS, SplitRecords
from distdiag.report.fastjson import loads

__all__ = ["pack", "unpack", "pack_many", "unpack_many", "decode", "encode_members", "decode_members", "history_key", "MAGIC", "LONG_LABEL"]

MAGIC = b"DDZ1"
"""What a packed value starts with (JSON text never does)."""
LONG_LABEL = 64
"""Labels longer than this go in the table (a label of 8 members is shorter: it stays)."""
MAX_UNPACKED = 64 * 2**20
"""The most a value may inflate to: a corrupt or hostile value stops there."""
_TABLE = "~labels"
_MANY = "~snaps"
_SHARED = "~recent"
"""In a pack_many value: the shared fields of its records; in one of its snapshots: the rows."""
_REF = "ranks@"
_REFS = re.compile(re.escape(_REF) + r"(\d+)")


def history_key(key: str) -> str:
    """Where the long history of the snapshots posted under `key` goes (`KEY/hist/<rank>`)."""
    return f"{key}/hist"


# -- the fields that carry a group's label ----------------------------------------------------
def _labelled(snap: dict[str, Any], *, copy: bool) -> list[dict[str, Any]]:
    """Every dict of the snapshot with a `group` label: the collective it waits in, its records,
    its position on each group (and the entry it waits in there), the recorder's entries.
    `copy`: each is replaced by a shallow copy first (packing must not touch the caller's dicts).
    (Plain loops: the writer runs this on 16k snapshots.)"""
    found: list[dict[str, Any]] = []
    cur = snap.get("in_collective")
    if isinstance(cur, dict):
        found.append(_own(snap, "in_collective", copy))
    for name in ("recent", "history"):
        records = snap.get(name)
        if isinstance(records, list):
            found += _items(snap, name, copy)
    engine = snap.get("engine")
    if isinstance(engine, dict):
        engine = _own(snap, "engine", copy)
        for name in ("groups", "entries"):
            if isinstance(engine.get(name), list):
                for g in _items(engine, name, copy):
                    found.append(g)
                    if isinstance(g.get("pending"), dict):
                        found.append(_own(g, "pending", copy))
    return found


def _own(holder: dict[str, Any], key: str, copy: bool) -> dict[str, Any]:
    if copy:
        holder[key] = dict(holder[key])
    return holder[key]


def _items(holder: dict[str, Any], key: str, copy: bool) -> list[dict[str, Any]]:
    """The dicts of the list holder[key] (copies of the list and of them with `copy`)."""
    if copy:
        holder[key] = [dict(d) if isinstance(d, dict) else d for d in holder[key]]
    return [d for d in holder[key] if isinstance(d, dict)]


class _Table:
    """The long labels of one packed value, each written once as its members' runs."""

    def __init__(self) -> None:
        self.table: dict[str, str] = {}
        self._refs: dict[tuple[int, ...], str] = {}

    def _ref(self, members: tuple[int, ...]) -> str:
        ref = self._refs.get(members)
        if ref is None:
            ref = self._refs[members] = f"{_REF}{len(self._refs)}"
            self.table[str(len(self._refs) - 1)] = encode_members(list(members))
        return ref

    def shorten(self, target: dict[str, Any]) -> None:
        """Long labels of `target` (a snapshot, or {"history": [...]}) by reference, in copies:
        a label's member list ('ranks[0,32,...]', `GroupId`) becomes `ranks@K`, what follows it
        (' (gloo)') stays."""
        for d in _labelled(target, copy=True):
            label = d.get("group")
            if isinstance(label, str) and len(label) > LONG_LABEL:
                members = parse_label(label).members
                if members:
                    d["group"] = self._ref(members) + label[label.index("]") + 1:]

    def packed(self, value: dict[str, Any]) -> bytes:
        if self.table:
            value[_TABLE] = self.table
        return MAGIC + zlib.compress(json.dumps(value, default=str).encode(), 1)


def pack(snap: dict[str, Any], *, history: bool = True) -> tuple[bytes, bytes | None]:
    """(the snapshot, its history) as store values; the history is None when it has none or
    `history` is False (it stays inside then)."""
    snap = dict(snap)
    hist = snap.pop("history", None) if history else None
    labels = _Table()
    labels.shorten(snap)
    wrapped = {"history": hist} if hist else None
    if wrapped is not None:
        labels.shorten(wrapped)
    return labels.packed(snap), (labels.packed(wrapped) if wrapped is not None else None)


def pack_many(snaps: dict[int, dict[str, Any]]) -> bytes:
    """Several snapshots (a node's, without their long histories) as one value, their labels
    in one table and their recent collectives split (`_split_recent`): what a node leader
    posts for its ranks."""
    labels = _Table()
    copies = {}
    shared: list[dict[str, Any]] = []
    index: dict[str, int] = {}
    for rank, snap in snaps.items():
        copy = copies[str(rank)] = dict(snap)
        copy.pop("history", None)
        labels.shorten(copy)
        _split_recent(copy, shared, index)
    value: dict[str, Any] = {_MANY: copies}
    if shared:
        value[_SHARED] = shared
    return labels.packed(value)


def _split_recent(snap: dict[str, Any], shared: list[dict[str, Any]], index: dict[str, int]) -> None:
    """The snapshot's recent records as rows [k, then the RECENT_COLUMNS values] under `~recent`,
    k the index in `shared` of the record with those columns None (a column it lacks stays
    absent); `index` finds a record's shared fields among those of the value so far. A list
    with anything but records stays as it is."""
    records = snap.get("recent")
    if not isinstance(records, list) or not all(isinstance(c, dict) for c in records):
        return
    rows = []
    for c in records:
        part = dict(c)
        for k in RECENT_COLUMNS:
            if k in part:
                part[k] = None
        try:
            key = json.dumps(part, sort_keys=True, default=str)
        except TypeError:  # keys json cannot sort (int and str mixed): the list goes as it is
            return
        if key not in index:
            index[key] = len(shared)
            shared.append(part)
        rows.append([index[key], *(c.get(k) for k in RECENT_COLUMNS)])
    del snap["recent"]
    snap[_SHARED] = rows


def unpack_many(value: Any, cache: dict[str, str] | None = None) -> dict[int, dict[str, Any]]:
    """The snapshots `pack_many` packed, by rank, with their labels back ({} for anything else)."""
    if not isinstance(value, dict) or not isinstance(value.get(_MANY), dict):
        return {}
    full = _resolved(value.pop(_TABLE, None), cache)
    shared = value.get(_SHARED)
    shared = [d if isinstance(d, dict) else {} for d in shared] if isinstance(shared, list) else []
    split = _Split(shared, full)
    out = {}
    for rank, snap in value[_MANY].items():
        if isinstance(snap, dict) and rank.isascii() and rank.isdigit():
            out[int(rank)] = _restore(snap, full)
            rows = snap.pop(_SHARED, None)
            if isinstance(rows, list):
                snap["recent"] = split.joined(rows)
    return out


_GROUP, _SEQ, _STEP, _DURATION = RECENT_COLUMNS  # the row's order after its index (four: unpacking says if not)


class _Split:
    """One value's shared record fields, with what each row needs of them worked out once for
    the value (not once a snapshot: a value of many snapshots and entries would take minutes)."""

    def __init__(self, shared: list[dict[str, Any]], full: dict[str, str]) -> None:
        self.shared = shared
        self.full = full
        self.refs = {_REF + key: label for key, label in full.items()}
        self.whole = [all(k in d for k in RECENT_COLUMNS) for d in shared]

    def joined(self, rows: list[Any]) -> SplitRecords:
        """The records `_split_recent` wrote as rows, whole again, group labels back; a
        malformed row (a corrupt or hostile value) is left out. (131k rows at 16k ranks: one
        dict display each, ~0.07 s; a copy and an update each took 0.17 s.)"""
        shared, whole, refs, full = self.shared, self.whole, self.refs, self.full
        records, at = [], []
        for row in rows:
            try:
                k, group, seq, step, duration = row
                if type(k) is not int or k < 0:
                    continue
                part = shared[k]
            except (TypeError, ValueError, IndexError):
                continue
            if type(group) is str and group.startswith(_REF):
                group = refs.get(group) or _REFS.sub(lambda m: full.get(m.group(1), m.group(0)), group)
            if whole[k]:
                c = {**part, _GROUP: group, _SEQ: seq, _STEP: step, _DURATION: duration}
            else:  # a column the record lacks stays absent
                c = part.copy()
                c.update((name, v) for name, v in zip(RECENT_COLUMNS, (group, seq, step, duration), strict=True) if name in c)
            records.append(c)
            at.append(k)
        return SplitRecords(records, shared, at)


def decode(raw: Any) -> Any:
    """The JSON value of a store value: packed (inflated, at most MAX_UNPACKED) or plain."""
    data = raw if isinstance(raw, bytes) else bytes(raw)
    if not data.startswith(MAGIC):
        return loads(data)
    inflater = zlib.decompressobj()
    text = inflater.decompress(data[len(MAGIC):], MAX_UNPACKED)
    if inflater.unconsumed_tail:
        raise ValueError(f"a packed snapshot inflates past {MAX_UNPACKED} bytes")
    return loads(text)


def unpack(value: Any, cache: dict[str, str] | None = None) -> Any:
    """A decoded snapshot (or history) with its labels back as `ranks[...]`; `cache` shares
    one string per distinct label across a gather (6k distinct groups for 16k snapshots)."""
    if not isinstance(value, dict):
        return value
    return _restore(value, _resolved(value.pop(_TABLE, None), cache))


def _resolved(table: Any, cache: dict[str, str] | None) -> dict[str, str]:
    """A value's label table as reference -> full label (one string per label through `cache`)."""
    if not isinstance(table, dict):
        return {}
    cache = {} if cache is None else cache
    full: dict[str, str] = {}
    for key, spec in table.items():
        spec = str(spec)
        if spec not in cache:
            try:
                cache[spec] = members_label(decode_members(spec))
            except ValueError:  # a corrupt or hostile entry: its references stay as they are
                continue
        full[str(key)] = cache[spec]
    return full


def _restore(snap: dict[str, Any], full: dict[str, str]) -> dict[str, Any]:
    if not full:
        return snap
    for d in _labelled(snap, copy=False):
        label = d.get("group")
        if isinstance(label, str) and label.startswith(_REF):
            d["group"] = full.get(label[len(_REF):]) or _REFS.sub(lambda m: full.get(m.group(1), m.group(0)), label)
    return snap
