"""Plain data out of an untrusted pickle (a flight-recorder dump), within bounds.

torch's dumps hold only dicts, lists, tuples, str, int, float, bool and None. The reader here
admits no global at all (`find_class` and `persistent_load` refuse, so nothing in the file
can call anything), and bounds what a small file could still make it do:

- memo size: every memo slot is a pointer; a file of MEMOIZE opcodes would grow the memo by
  8 bytes per byte read;
- time: a file that takes longer than a dump could to read is refused, not read for ever;
- what the data expands to: a pickle shares objects through its memo, so 550 bytes can build a
  list whose two items are the same list, 60 times over: a small graph that every walk over
  the data (type checks, the analysis, JSON output) sees as 2^60 values. `plain_problem`
  counts the data as the walks see it, in time linear in the graph, with its nesting depth and
  without following a cycle; a list of ten million numbers is refused by the same count.

pickle's pure-Python unpickler is used (its opcodes can be counted and bounded; the C one
cannot be interrupted): about 4 million opcodes a second, 0.03 s for a dump of 2000 entries.
"""

from __future__ import annotations

import io
import pickle
import time
from collections.abc import Callable
from typing import Any

from distdiag.errors import DistDiagError

__all__ = ["PlainPickleError", "MAX_MEMO", "MAX_VALUES", "MAX_DEPTH", "MAX_READ_S", "load_plain", "plain_problem"]

MAX_MEMO = 4_000_000
"""Memo slots at most (a dump of 2000 entries uses a few hundred)."""
MAX_VALUES = 5_000_000
"""Values (containers and scalars, counted as a walk over the data sees them) at most: a dump of
torch's default 2000 entries holds about 70 per entry with call stacks, 140,000 in all."""
MAX_DEPTH = 64
"""Nesting depth at most (a dump nests 5 deep)."""
MAX_READ_S = 20.0
"""Seconds one file may take to unpickle."""


class PlainPickleError(DistDiagError, ValueError):
    """Not plain data within the bounds; the message is one line ('it ...')."""


_MEMO_OPS = {op[0] for op in (pickle.MEMOIZE, pickle.PUT, pickle.BINPUT, pickle.LONG_BINPUT)}
_GROW_OPS = {op[0] for op in (pickle.APPEND, pickle.APPENDS, pickle.SETITEM, pickle.SETITEMS)}
"""The opcodes that add to the list or dict on top of the stack: its size is bounded as it grows,
so a list of millions of items is refused after MAX_VALUES of them, not after reading it all
(which took over MAX_READ_S on a loaded node)."""


def _bounded(op: Callable[[Any], None], memo: bool, grows: bool = False) -> Callable[[Any], None]:
    def run(self: _PlainUnpickler) -> None:
        op(self)
        self.ops += 1
        if memo and len(self.memo) > MAX_MEMO:  # type: ignore[attr-defined]  # the pure-Python Unpickler's, not in typeshed
            raise PlainPickleError(f"it memoizes over {MAX_MEMO:,} objects; a flight-recorder dump holds far fewer")
        if grows and len(self.stack[-1]) > MAX_VALUES:  # type: ignore[attr-defined]  # as above
            raise PlainPickleError(f"a list or table in it has over {MAX_VALUES:,} items; no flight-recorder dump does")
        if not self.ops & 0xFFFF and time.monotonic() > self.deadline:
            raise PlainPickleError(f"it takes over {MAX_READ_S:g} s to unpickle; no flight-recorder dump does")

    return run


class _PlainUnpickler(pickle._Unpickler):  # the pure-Python unpickler: its opcodes can be bounded
    """Loads plain containers and scalars only: any global (hence any call) is refused."""

    dispatch = {code: _bounded(op, code in _MEMO_OPS, code in _GROW_OPS) for code, op in pickle._Unpickler.dispatch.items()}

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.ops = 0
        self.deadline = time.monotonic() + MAX_READ_S

    def find_class(self, module: str, name: str) -> Any:
        raise PlainPickleError(f"it asks to load {module}.{name}; a flight-recorder dump holds plain data only, "
                               "so it was refused before anything ran")

    def persistent_load(self, pid: Any) -> Any:
        raise PlainPickleError("it refers to a persistent object; a flight-recorder dump holds plain data only")


def load_plain(data: bytes) -> Any:
    """The plain data in a pickle, checked with `plain_problem`. Raises PlainPickleError for
    anything else; other errors (a broken pickle) propagate as the unpickler raises them."""
    loaded = _PlainUnpickler(data).load()
    problem = plain_problem(loaded)
    if problem:
        raise PlainPickleError(problem)
    return loaded


def _children(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return [*node.keys(), *node.values()]
    return list(node)


def plain_problem(data: Any, max_values: int = MAX_VALUES, max_depth: int = MAX_DEPTH) -> str | None:
    """Why `data` is too big to walk (values as a walk counts them, shared objects once per
    reference), too deep, or cyclic; None when it is fine. Linear in the objects it holds."""
    if not isinstance(data, dict | list | tuple):
        return None
    sizes: dict[int, int] = {}
    heights: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(data, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            on_path.discard(key)
            every = _children(node)
            kids = [k for k in every if isinstance(k, dict | list | tuple)]
            sizes[key] = 1 + len(every) - len(kids) + sum(sizes[id(k)] for k in kids)
            heights[key] = 1 + max((heights[id(k)] for k in kids), default=0)
            if sizes[key] > max_values:
                return (f"it holds over {max_values:,} values (a list of millions of numbers, or one list shared "
                        "many times over through the pickle's memo); a flight-recorder dump holds far fewer")
            if heights[key] > max_depth:
                return f"it nests deeper than {max_depth} levels"
            continue
        if key in sizes:
            continue
        if key in on_path:
            return "it contains itself (a cycle); a flight-recorder dump is a tree of plain data"
        if len(node) > max_values:
            return f"a list or table in it has {len(node):,} items, over {max_values:,}; no flight-recorder dump does"
        on_path.add(key)
        stack.append((node, True))
        stack.extend((k, False) for k in _children(node) if isinstance(k, dict | list | tuple))
    return None
