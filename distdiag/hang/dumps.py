"""Flight-recorder dump files as torch writes them, read without running anything in them.

torch writes one file per rank, `<prefix><rank>` (TORCH_FR_DUMP_TEMP_FILE, or NCCL's
TORCH_NCCL_DEBUG_INFO_TEMP_FILE, default `/tmp/nccl_trace_rank_`), in pickle by default and
in JSON on request (`_dump_fr_trace_json`). Both are read here:

- pickle through the pure-Python unpickler (its memo a dict, so no index can make it allocate)
  admitting no global at all (`find_class` and
  `persistent_load` refuse): torch's dumps hold only dicts, lists, tuples, str, int, float,
  bool and None, so they load as they are, while a file that would call anything (REDUCE,
  BUILD, INST... all need a global first) is refused in one line before anything runs;
- JSON as it is.

Every field the analysis reads is type-checked first (`dump_problem`), after a bound on depth
and on values reached (a shared value counted each time: a "memo bomb"), so a wrong type or a
hostile file is one line, never a traceback or a walk that does not end. Dump versions 2.2 to 2.10 differ in fields that are added, not
changed (`nccl_version` became `comm_lib_version`; `pg_status`, `is_p2p`, `frames` appear on
the way; gloo writes numbers as strings): hang/dumpgroups.py reads them all. Torch-free.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from distdiag.errors import DistDiagError
from distdiag.hang.plainpickle import PlainPickleError, load_plain, plain_problem

__all__ = ["DumpError", "MAX_DUMP_BYTES", "MAX_RANK", "MAX_NODES", "load_dump", "parse_dump", "dump_problem", "rank_of",
           "as_int", "is_dump"]

MAX_DUMP_BYTES = 256 << 20
"""A dump of torch's default 2000 entries with stacks is a few MB; beyond this it is no dump
(and loading it would take several times its size in memory)."""
MAX_RANK = 1 << 20
"""No job has a million ranks: a larger number in a file name is a timestamp or a pid."""
_MAX_DEPTH = 64
MAX_NODES = 10_000_000
"""Values in a dump, counting a shared one each time it is reached: torch's largest buffers
(tens of thousands of entries with deep stacks) hold a few million; a pickle that reuses its
memo to multiply a few hundred bytes into billions (a "memo bomb") is refused here."""
MAX_ENTRIES = 1_000_000


class DumpError(DistDiagError, ValueError):
    """A file that is not a readable flight-recorder dump; the message is one line."""


def parse_dump(data: bytes, where: str) -> Any:
    """The object in one dump's bytes (pickle or JSON). Raises DumpError."""
    if data[:1] == b"\x80":
        try:
            return load_plain(data)  # no globals, memo, size, depth and time bounded: hang/plainpickle.py
        except PlainPickleError as exc:
            raise DumpError(f"{where} is not a plain flight-recorder dump: {exc}") from None
        except RecursionError:
            raise DumpError(f"{where} nests too deeply to read: not a flight-recorder dump") from None
        except Exception as exc:  # noqa: BLE001 - any broken pickle is one line
            raise DumpError(f"{where} is a broken pickle ({type(exc).__name__}): not a flight-recorder dump") from None
    try:
        loaded = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise DumpError(f"{where} is neither JSON nor a pickle flight-recorder dump") from None
    except RecursionError:
        raise DumpError(f"{where} nests JSON too deeply to read: not a flight-recorder dump") from None
    problem = plain_problem(loaded)  # the same bounds as a pickle's (a list of 10^7 numbers)
    if problem:
        raise DumpError(f"{where} is not a plain flight-recorder dump: {problem}")
    return loaded


def load_dump(path: Path) -> dict[str, Any]:
    """One rank's dump, checked. Raises DumpError (one line) or OSError."""
    size = path.stat().st_size
    if size > MAX_DUMP_BYTES:
        raise DumpError(f"{path} is {size >> 20} MiB, larger than any flight-recorder dump "
                        f"(limit {MAX_DUMP_BYTES >> 20} MiB): not read")
    loaded = parse_dump(path.read_bytes(), str(path))
    if not is_dump(loaded):
        raise DumpError(f"{path} is not a flight-recorder dump (no 'entries')")
    problem = dump_problem(loaded)
    if problem:
        raise DumpError(f"{path} is not a flight-recorder dump: {problem}")
    return loaded


def is_dump(loaded: Any) -> bool:
    """A flight-recorder dump: an object with 'entries', or (torch's JSON with nothing to list
    leaves 'entries' out) a version with the group tables."""
    if not isinstance(loaded, dict):
        return False
    return "entries" in loaded or ("version" in loaded and ("pg_config" in loaded or "pg_status" in loaded))


def as_int(value: Any) -> int | None:
    """A sequence number or counter: an int, or a string of digits (gloo's JSON); else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"-?\d{1,19}", value.strip()):
        return int(value)
    return None


def _size_problem(obj: Any) -> str | None:
    """Too deep, or too many values (shared ones counted each time they are reached, as every
    later walk over the dump would), counted without recursion and stopping at the limit."""
    stack, seen = [(obj, 1)], 1
    while stack:
        item, d = stack.pop()
        if d > _MAX_DEPTH:
            return f"it nests deeper than {_MAX_DEPTH} levels"
        seen += len(item)
        if seen > MAX_NODES:
            return (f"it holds more than {MAX_NODES:,} values (counting each reuse of a shared one): "
                    "larger than any flight-recorder dump")
        values = item.values() if isinstance(item, dict) else item
        stack.extend((v, d + 1) for v in values if isinstance(v, dict | list | tuple))
    return None


def _number_problem(where: str, value: Any) -> str | None:
    if value is not None and as_int(value) is None:
        return f"{where} must be an integer (or a string of digits), got {value!r:.60}"
    return None


def _sizes_problem(where: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or any(
            not isinstance(s, list | tuple) or any(as_int(x) is None for x in s) for s in value):
        return f"{where} must be a list of shapes (lists of integers), got {value!r:.60}"
    return None


def _entry_problem(i: int, entry: Any) -> str | None:
    if not isinstance(entry, dict):
        return f"entries[{i}] must be an object, got {type(entry).__name__}"
    for key in ("collective_seq_id", "p2p_seq_id", "pg_id", "record_id"):
        problem = _number_problem(f"entries[{i}].{key}", entry.get(key))
        if problem:
            return problem
    group = entry.get("process_group")
    if group is not None and (not isinstance(group, list | tuple) or not group
                              or not all(isinstance(x, str | int) for x in group)):
        return f"entries[{i}].process_group must be a non-empty list (name, desc), got {group!r:.60}"
    for key in ("profiling_name", "state"):
        if not isinstance(entry.get(key, ""), str):
            return f"entries[{i}].{key} must be a string, got {entry.get(key)!r:.60}"
    if not isinstance(entry.get("is_p2p", False), bool):
        return f"entries[{i}].is_p2p must be true or false, got {entry.get('is_p2p')!r:.60}"
    for key in ("input_sizes", "output_sizes"):
        problem = _sizes_problem(f"entries[{i}].{key}", entry.get(key))
        if problem:
            return problem
    for key in ("input_dtypes", "output_dtypes", "frames"):
        if entry.get(key) is not None and not isinstance(entry.get(key), list | tuple):
            return f"entries[{i}].{key} must be a list, got {type(entry.get(key)).__name__}"
    return None


def _tables_problem(dump: dict[str, Any]) -> str | None:
    for key in ("pg_config", "pg_status"):
        table = dump.get(key)
        if table is None:
            continue
        if not isinstance(table, dict):
            return f"'{key}' must be an object, got {type(table).__name__}"
        for name, value in table.items():
            if not isinstance(value, dict):
                return f"'{key}'[{name!r:.40}] must be an object, got {type(value).__name__}"
            if key == "pg_config" and not isinstance(value.get("ranks", ""), str | list | tuple):
                return f"'pg_config'[{name!r:.40}].ranks must be a list or a string like '[0, 1]'"
            if key == "pg_status":
                for field, count in value.items():
                    problem = _number_problem(f"'pg_status'[{name!r:.40}].{field}", count)
                    if problem:
                        return problem
    return None


def dump_problem(dump: Any) -> str | None:
    """The first field of a dump whose type the analysis cannot use, or None."""
    if not isinstance(dump, dict):
        return f"the dump is a {type(dump).__name__}, not an object"
    problem = _size_problem(dump) if isinstance(dump, dict) else None
    if problem:
        return problem
    rank = dump.get("rank")
    if rank is not None and (as_int(rank) is None or not 0 <= as_int(rank) < MAX_RANK):  # type: ignore[operator]
        return f"'rank' must be an integer from 0 to {MAX_RANK - 1}, got {rank!r:.60}"
    if not isinstance(dump.get("version", ""), str | int | float):
        return f"'version' must be a string like '2.10', got {type(dump.get('version')).__name__}"
    problem = _tables_problem(dump)
    if problem:
        return problem
    entries = dump.get("entries")
    if entries is None:
        return None
    if not isinstance(entries, list | tuple):
        return f"'entries' must be a list, got {type(entries).__name__}"
    if len(entries) > MAX_ENTRIES:
        return f"it has {len(entries):,} entries, more than any flight-recorder buffer ({MAX_ENTRIES:,})"
    for i, entry in enumerate(entries):
        problem = _entry_problem(i, entry)
        if problem:
            return problem
    return None


_SUFFIXES = (".json", ".pkl", ".pickle", ".bin")


def _rank_in(name: str) -> re.Match[str] | None:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return re.search(r"_rank_?(\d+)$", name) or re.search(r"(\d+)$", name)


def rank_of(path: Path, dump: dict[str, Any], folder_per_rank: bool = False) -> int:
    """The rank that wrote a dump: its own `rank` field, else the number ending its file name
    (torch names files `<prefix><rank>`, e.g. nccl_trace_rank_3, host-prefixed
    node7_nccl_trace_rank_3, or trace_3[.json]); with `folder_per_rank`, else the number ending
    its folder's name (rank_3/trace). Raises DumpError for a name without one, or a number no
    rank has (a timestamp, a pid)."""
    own = as_int(dump.get("rank"))
    if own is not None:
        return own
    match = _rank_in(path.name) or (_rank_in(path.parent.name) if folder_per_rank else None)
    if not match:
        raise DumpError(f"cannot tell which rank wrote {path}: the dump has no 'rank' and its name does not end in "
                        "one; name dump files <prefix><rank> as torch does (e.g. nccl_trace_rank_3)")
    if len(match.group(1)) > 7 or int(match.group(1)) >= MAX_RANK:
        raise DumpError(f"cannot tell which rank wrote {path}: its name ends in {match.group(1)}, which is no rank "
                        f"(ranks are below {MAX_RANK}; a timestamp or pid?); name dump files <prefix><rank> as torch "
                        "does (e.g. nccl_trace_rank_3)")
    return int(match.group(1))
