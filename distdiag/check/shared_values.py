"""Payload values that every rank posts alike, stored once (issue 21).

A probe names the fields of its payload that are usually the same on every rank
(`Probe.shared_fields`: setup_sync's per-tensor digests of the model, 24 KB a rank for the
built-in workload and as much as the model has tensors for a user's). At 16k ranks posting
them whole put 400 MB into torchrun's store, and the writer read it all back. Instead each rank
stores a field's JSON under a key named by its hash, only when no rank stored it yet, and posts
a reference; the writer reads and parses each distinct value once, in batches, and every rank
that referenced it gets that one object: consolidation sees the payloads it saw before, and a
probe may judge each distinct object once for all the ranks that hold it (distdiag.probes.base
`alike`) - at 16k ranks parsing setup_sync's digests once per rank alone took seconds. So a
consolidation reads shared fields and never changes them (tests/unit/test_check_equivalence.py
checks the probes that declare some). A field that differs between ranks (the bug the probe
reports) costs one value per rank, as before, plus a check and a reference.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from distdiag.runtime.exchange import BATCH, PARTS, Exchange, bounded
from distdiag.runtime.keys import Keys

__all__ = ["SHARED", "SHARE_MIN_BYTES", "shared_key", "share_fields", "resolve_shared"]

SHARED = "__distdiag_shared__"
"""The one key of the reference a rank posts in place of a shared field's value."""
SHARE_MIN_BYTES = 1024
"""A field whose JSON is shorter is posted as it is: a reference would save nothing."""


def shared_key(index: int, digest: str) -> str:
    """Where the value with this hash of probe `index`'s payloads is stored."""
    return Keys.shared(index, digest)


def share_fields(ex: Exchange, index: int, entry: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    """`entry` with each of its payload's `fields` (when large) stored once and referenced."""
    payload = entry.get("payload")
    if entry.get("status") != "ok" or not fields or not isinstance(payload, dict):
        return entry
    keys: dict[str, str] = {}
    for field in fields:
        if field in payload:
            text = json.dumps(payload[field], default=str)
            if len(text) >= SHARE_MIN_BYTES:
                keys[field] = shared_key(index, hashlib.sha256(text.encode()).hexdigest()[:32])
    if not keys:
        return entry
    # One round trip when some rank stored them all already (every rank but the first, when healthy).
    with bounded(f"check {Keys.result(index)}/shared"):
        stored = ex.store.check(list(keys.values()))
    for field, key in keys.items():
        if stored:
            break
        with bounded(f"check {key}"):
            exists = ex.store.check([key])
        if not exists:  # two ranks storing it at once store the same bytes
            ex.publish(key, payload[field])
    out = {**payload, **{field: {SHARED: key.rsplit("/", 1)[1]} for field, key in keys.items()}}
    return {**entry, "payload": out}


def _reference(value: object) -> str | None:
    return value[SHARED] if isinstance(value, dict) and len(value) == 1 and SHARED in value else None


def resolve_shared(ex: Exchange, index: int, posted: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The entries as the ranks made them: each reference replaced by its value, parsed once
    and the same object for every rank that referenced it (read-only to consolidation)."""
    refs: dict[str, list[tuple[dict[str, Any], str]]] = {}
    for entry in posted.values():
        payload = entry.get("payload")
        if entry.get("status") == "ok" and isinstance(payload, dict):
            for field, value in payload.items():
                digest = _reference(value)
                if digest is not None:
                    refs.setdefault(digest, []).append((payload, field))
    digests = list(refs)
    for start in range(0, len(digests), BATCH):
        part = digests[start : start + BATCH]
        keys = [shared_key(index, d) for d in part]
        with bounded(f"multi_get {Keys.result(index)}/shared"):
            raws = [bytes(v) for v in ex.store.multi_get(keys)]
        for digest, key, raw in zip(part, keys, raws, strict=True):
            value = json.loads(raw)
            if isinstance(value, dict) and len(value) == 1 and PARTS in value:
                value = ex.read(key)  # a value over 63 KB: read with its parts
            for payload, field in refs[digest]:
                payload[field] = value
    return posted
