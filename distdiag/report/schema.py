"""Type checks of a report's JSON before it is read back (`read_report`).

`Report.from_dict` trusts the types it is given; a hand-edited or foreign file with
`"findings": 5` or an entry that is a list would crash a renderer instead of saying what is
wrong. These pure checks name the first bad field by its JSON path.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_DEPTH", "json_depth", "report_type_problem"]

MAX_DEPTH = 64
"""Deepest JSON nesting a report may have (a real one nests about 8 levels); deeper data is
refused, so that no reader or writer of it recurses past Python's limit."""


def json_depth(value: Any) -> int:
    """How deeply lists and dicts nest in `value` (iterative: safe on any depth)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


_STR, _INT, _NUM, _LIST, _DICT = "a string", "an integer", "a number", "a list", "an object"


def _type_name(value: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def _is(value: Any, want: str) -> bool:
    if want == _STR:
        return isinstance(value, str)
    if want == _INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if want == _NUM:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if want == _LIST:
        return isinstance(value, list)
    return isinstance(value, dict)


def _fields(obj: dict[str, Any], where: str, spec: dict[str, str], required: tuple[str, ...] = ()) -> str | None:
    for key in required:
        if key not in obj:
            raise KeyError(f"{where}{key}")
    for key, want in spec.items():
        if key in obj and obj[key] is not None and not _is(obj[key], want):
            return f"{where}{key} must be {want}, got {_type_name(obj[key])}"
    return None


_TOP = {
    "world_size": _INT, "exit_code": _INT, "verdict": _STR, "outcome": _STR, "summary": _STR, "restart_count": _INT,
    "run_id": _STR, "launch_id": _STR, "created": _STR, "duration_s": _NUM, "written_by": _INT, "ranks": _LIST, "probes": _LIST,
    "not_run": _LIST, "notes": _LIST, "config": _DICT, "distdiag_version": _STR, "torch_version": _STR,
    "hostlist": _STR,
}
_RANK = {"rank": _INT, "host": _STR, "node": _INT, "local_rank": _INT, "device": _STR, "pid": _INT}
_PROBE = {"name": _STR, "status": _STR, "findings": _LIST, "metrics": _DICT, "duration_s": _NUM, "details": _DICT, "reason": _STR}
_FINDING = {"severity": _STR, "issue": _STR, "evidence": _STR, "ranks": _LIST, "fix": _STR, "confidence": _NUM, "drain": _DICT, "cause": _STR}


def report_type_problem(data: dict[str, Any]) -> str | None:
    """The first field of a report's JSON whose type is wrong ("probes[0].findings must be a
    list, got number"), or None. Missing required fields raise KeyError naming them."""
    try:
        problem = _fields(data, "", _TOP, ("world_size",))
        if problem:
            return problem
        if not 0 <= data.get("exit_code", 0) <= 255:
            return f"exit_code must be within [0, 255], got {data['exit_code']}"
        for i, name in enumerate(data.get("not_run") or []):
            if not isinstance(name, str):
                return f"not_run[{i}] must be a string, got {_type_name(name)}"
        for i, rank in enumerate(data.get("ranks") or []):
            if not isinstance(rank, dict):
                return f"ranks[{i}] must be an object, got {_type_name(rank)}"
            problem = _fields(rank, f"ranks[{i}].", _RANK, tuple(_RANK))
            if problem:
                return problem
        for i, probe in enumerate(data.get("probes") or []):
            if not isinstance(probe, dict):
                return f"probes[{i}] must be an object, got {_type_name(probe)}"
            problem = _fields(probe, f"probes[{i}].", _PROBE, ("name", "status"))
            if problem:
                return problem
            for j, finding in enumerate(probe.get("findings") or []):
                where = f"probes[{i}].findings[{j}]"
                if not isinstance(finding, dict):
                    return f"{where} must be an object, got {_type_name(finding)}"
                problem = _fields(finding, where + ".", _FINDING, ("severity", "issue"))
                if problem:
                    return problem
                if not all(_is(r, _INT) for r in finding.get("ranks") or []):
                    return f"{where}.ranks must be a list of integers"
    except KeyError as exc:
        return f"missing field {exc.args[0]}"
    return None
