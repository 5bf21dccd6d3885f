"""Every probe that swallows an exception publishes it (ctx.caught / publish_caught) first.

A probe that catches an exception and goes on to its next collective may have left other
ranks waiting in a collective the raising rank never entered; the hang report can only lead
with that rank's exception if the probe published it out of band. A source scan: each
`except` block that catches Exception (or BaseException, or everything) in distdiag/probes
must call `ctx.caught(...)` or `publish_caught(...)`, unless its `except` line says
`strands no one` (a local lookup before any collective).
"""

from __future__ import annotations

import ast
from pathlib import Path

import distdiag.probes

PROBES_DIR = Path(distdiag.probes.__file__).parent
MARK = "strands no one"
BROAD = {"Exception", "BaseException", "MemoryError", "CheckpointException"}
"""CheckpointException: DCP's failure gathered from every rank, a BaseException."""


def _broad(handler: ast.ExceptHandler) -> bool:
    kinds = handler.type
    if kinds is None:
        return True
    names = kinds.elts if isinstance(kinds, ast.Tuple) else [kinds]
    return any(isinstance(n, ast.Name) and n.id in BROAD for n in names)


def _publishes(handler: ast.ExceptHandler) -> bool:
    for node in ast.walk(ast.Module(body=handler.body, type_ignores=[])):
        if isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Attribute) and fn.attr == "caught":
                return True
            if isinstance(fn, ast.Name | ast.Attribute) and getattr(fn, "id", getattr(fn, "attr", "")) == "publish_caught":
                return True
    return False


def unpublished_handlers(source: str) -> list[int]:
    """Line numbers of broad `except` blocks that neither publish nor carry the mark."""
    lines = source.splitlines()
    return [
        h.lineno for h in ast.walk(ast.parse(source))
        if isinstance(h, ast.ExceptHandler) and _broad(h) and not _publishes(h) and MARK not in lines[h.lineno - 1]
    ]


def test_every_broad_except_in_a_probe_publishes_what_it_caught():
    missing = {
        path.name: lines
        for path in sorted(PROBES_DIR.glob("*.py"))
        if (lines := unpublished_handlers(path.read_text()))
    }
    assert missing == {}, (
        f"these except blocks swallow an exception without ctx.caught(exc, where) (or a '# {MARK}: why' mark "
        f"on the except line): {missing}"
    )


def test_the_scan_sees_a_silent_handler_and_accepts_the_published_and_marked_ones():
    """The scan itself: a silent broad except is caught; ctx.caught, publish_caught and the mark pass."""
    silent = "try:\n    f()\nexcept Exception as exc:\n    x = exc\n"
    published = "try:\n    f()\nexcept Exception as exc:\n    ctx.caught(exc, 'f')\n"
    via_errors = "try:\n    f()\nexcept (ValueError, Exception) as exc:\n    publish_caught(exc)\n"
    marked = f"try:\n    f()\nexcept Exception:  # {MARK}: a local lookup\n    pass\n"
    narrow = "try:\n    f()\nexcept ValueError:\n    pass\n"
    bare = "try:\n    f()\nexcept:\n    pass\n"
    assert unpublished_handlers(silent) == [3] and unpublished_handlers(bare) == [3]
    assert [unpublished_handlers(s) for s in (published, via_errors, marked, narrow)] == [[], [], [], []]
