"""Stranded ranks at scale: one line per chain *shape*, not one per rank.

At 16k ranks a hang strands thousands of ranks, each with its chain of waits
(distdiag.hang.waitfor). Their chains repeat: every replica's data-parallel rank waits the same
way, through a group of the same size and the same collective, on the same culprit. A shape
is that sequence of waits with the groups' members left out (kept: the op, its number, the
group's size, the dtype and shape), and how the chain ends (the culprit's state and place).
Each shape is one line: the ranks (compressed, distdiag.report.render.compress_numbers),
their hosts, how many, the waits, and the ranks at the end. At most `SHAPE_LINES` lines, then
'... and K more shapes'. Linear in the ranks times their chains' length.
"""

from __future__ import annotations

import re
from typing import Any

from distdiag.hang.waitfor import End, Wait
from distdiag.report.render import format_hosts, format_ranks

__all__ = ["SHAPE_LINES", "wait_shape", "shape_lines", "counted_shape_lines"]

SHAPE_LINES = 12
"""Shapes written out in a finding; the rest are counted on one line."""

_MEMBERS = re.compile(r" on ranks\[[^\]]*\](?: \(\d+ ranks\))?")
_RANK = re.compile(r"\brank \d+")
_LEAD = re.compile(r"^rank \d+ ")

_PLURAL = {"is": "are", "was": "were", "waits": "wait"}

Analysis = Any
"""distdiag.hang.rules.Analysis (rules.py imports this module, so not imported back here)."""


def wait_shape(w: Wait) -> str:
    """'all_reduce #11 on a 512-rank group (bfloat16[1048576])': the wait without its members."""
    if w.peer is not None:
        return _RANK.sub("its peer", w.label)
    return _MEMBERS.sub(f" on a {len(w.group)}-rank group", w.label)


def _end_key(end: End) -> tuple[str, str]:
    """(kind, what the end is doing without its rank): ends in the same state at the same
    place are one end of one shape ('is at data.py:58 in load_next_microbatch')."""
    if end.kind == "deadlock":
        return end.kind, "in a deadlock between groups"
    return end.kind, _LEAD.sub("", end.text, count=1).strip()


def _hosts(a: Analysis, ranks: list[int]) -> str:
    hosts = [str(a.views[r].snap.get("host")) for r in ranks if r in a.views and a.views[r].snap.get("host")]
    if not hosts:
        return ""
    names = sorted(set(hosts))
    return f"on {'host' if len(names) == 1 else f'{len(names)} hosts'} {format_hosts(names)}, "


def shape_lines(a: Analysis, ranks: list[int], limit: int | None = None) -> list[str]:
    """One line per chain shape among the stranded `ranks`, most ranks first, at most `limit`.
    No more ranks than lines: each rank's own chain (`rank 0 waits for 2 in ...; rank 2 ...`)."""
    return counted_shape_lines(a, ranks, limit)[0]


def counted_shape_lines(a: Analysis, ranks: list[int], limit: int | None = None) -> tuple[list[str], int]:
    """(shape_lines, how many chain shapes there are in all, written out or counted)."""
    limit = SHAPE_LINES if limit is None else limit
    if len(ranks) <= limit:
        chains = a.graph.chains(ranks)
        return chains, len(chains)
    by_shape: dict[tuple[Any, ...], tuple[list[int], set[int]]] = {}
    # thousands of chains share a few waits and ends: each one's text worked out once
    shape_of: dict[Wait, str] = {}
    end_key: dict[int, tuple[str, str]] = {}
    for r in sorted(ranks):
        chain = a.graph.stranded.get(r)
        if chain is None:
            continue
        end = a.graph.end_of[r]
        waits = []
        for e in chain:
            shape = shape_of.get(e.wait)
            if shape is None:
                shape = shape_of[e.wait] = wait_shape(e.wait)
            waits.append(shape)
        if id(end) not in end_key:
            end_key[id(end)] = _end_key(end)
        key = (tuple(waits), end_key[id(end)])
        who, ends = by_shape.setdefault(key, ([], set()))
        who.append(r)
        ends.update(end.ranks if end.kind != "stall" else ())
    shapes = sorted(by_shape.items(), key=lambda kv: (-len(kv[1][0]), kv[1][0][0]))
    lines = []
    for (waits, (_kind, state)), (who, ends) in shapes[:limit]:
        if len(ends) > 1:  # 'ranks 8-15 were lost', not 'was'
            state = re.sub(r"^(is|was|waits|raised|finished) ", lambda m: _PLURAL.get(m.group(1), m.group(1)) + " ", state)
        at = f"{format_ranks(sorted(ends))} {state}" if ends else state
        lines.append(f"{format_ranks(who)} ({_hosts(a, who)}{len(who)} rank{'s' if len(who) != 1 else ''}) "
                     f"wait{'s' if len(who) == 1 else ''} through {' -> '.join(waits)} -> {at}")
    rest = shapes[limit:]
    if rest:
        lines.append(f"... and {len(rest)} more shapes ({sum(len(w) for _k, (w, _e) in rest)} ranks): "
                     "every rank's wait is in the table of ranks")
    return lines, len(shapes)
