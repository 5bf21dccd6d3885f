"""torch's flight recorder: enable it before init, take its tail at a hang, read its dumps.

The recorder sees collectives that bypass the Python API (functional collectives under
torch.compile, C++ callers), so its tail goes into each rank's snapshot when it is on. We do
not depend on it: on gloo its dumps carry no group membership, every entry stays
`scheduled` and torch's own analyser crashes on them (docs/watchdog.md). Dumps are read as
JSON; pickle dumps (NCCL's default, the only form with stacks) only when the caller trusts
them, because unpickling runs code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["FR_BUFFER_ENV", "recorder_enabled", "enable_recorder", "recorder_tail", "load_dump", "summarize_dump"]

FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
_LEGACY_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"


def recorder_enabled() -> bool:
    raw = os.environ.get(FR_BUFFER_ENV) or os.environ.get(_LEGACY_ENV) or "0"
    try:
        return int(raw) > 0
    except ValueError:
        return False


def enable_recorder(entries: int) -> str | None:
    """Turn the recorder on for process groups created from now on; returns a warning or None."""
    if entries <= 0:
        return None
    current = os.environ.get(FR_BUFFER_ENV) or os.environ.get(_LEGACY_ENV)
    if current:
        return None if current == str(entries) else f"keeping the user's {FR_BUFFER_ENV}={current} (not {entries})"
    os.environ[FR_BUFFER_ENV] = str(entries)
    return None


def _compact(entry: dict[str, Any]) -> dict[str, Any]:
    pg = entry.get("process_group") or ["?", "?"]
    return {
        "pg": str(pg[1] if len(pg) > 1 else pg[0]),
        "seq": entry.get("collective_seq_id", entry.get("p2p_seq_id")),
        "op": str(entry.get("profiling_name", "?")).split(":", 1)[-1],
        "sizes": entry.get("input_sizes"),
        "dtypes": entry.get("input_dtypes"),
        "state": entry.get("state"),
    }


def recorder_tail(limit: int = 16) -> list[dict[str, Any]]:
    """The last entries of this process's recorder (empty when it is off or unavailable)."""
    if not recorder_enabled():
        return []
    try:
        import torch

        raw = torch._C._distributed_c10d._dump_fr_trace_json(True, True)
        entries = json.loads(raw).get("entries") or []
    except Exception:  # noqa: BLE001 - the recorder is a bonus, never a failure
        return []
    return [_compact(e) for e in entries[-limit:]]


def load_dump(path: Path, *, trust_pickle: bool = False) -> dict[str, Any]:
    """One rank's recorder dump. Raises ValueError with a one-line reason."""
    data = path.read_bytes()
    if data[:1] == b"\x80":
        if not trust_pickle:
            raise ValueError(
                f"{path} is a pickle dump; reading it runs code from the file - pass --trust-pickle if you trust it"
            )
        import pickle

        loaded = pickle.loads(data)  # noqa: S301 - the user asked for it explicitly
    else:
        try:
            loaded = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError(f"{path} is neither JSON nor a pickle flight-recorder dump") from None
    if not isinstance(loaded, dict) or "entries" not in loaded:
        raise ValueError(f"{path} is not a flight-recorder dump (no 'entries')")
    return loaded


def summarize_dump(dump: dict[str, Any]) -> dict[str, Any]:
    """Per process group: the last entry, in the compact form snapshots use."""
    last: dict[str, dict[str, Any]] = {}
    for entry in dump.get("entries") or []:
        if entry.get("is_p2p"):
            continue
        c = _compact(entry)
        if c["seq"] is None:
            continue
        if c["pg"] not in last or int(c["seq"]) >= int(last[c["pg"]]["seq"]):
            last[c["pg"]] = c
    return {"last": last, "tail": [_compact(e) for e in (dump.get("entries") or [])[-8:]]}
