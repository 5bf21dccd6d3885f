"""Per process group, the frontier and the members that never entered it: the one computation
behind both verdicts, the flight-recorder dumps' (hang/frontier.py) and the live snapshots'
(hang/waitfor.py, through hang/views.py).

A member's position on a group is the last collective sequence number it enqueued and the last
it completed, as its flight recorder says (`Pos`). From the positions of every member:

- a member is *inside* the op at `seq` when it enqueued it and has not completed it; the only
  op of a group a member can be waiting in there is its oldest open one (`open_seq`): the ones
  it enqueued after it are queued behind it;
- a member *never entered* the op at `seq` when its enqueued count is below `seq`, or nothing
  of it is known (no dump, no snapshot, nothing recorded on the group) (`never_entered`);
- on NCCL a collective completes on one member only once every member's kernel ran it, so what
  any member completed every member entered, whatever its own (possibly frozen) record says
  (`completed_anywhere`). Not on gloo: a broadcast's receivers complete once the root's data
  reached them, while the root still waits for a receiver that never came; the live path,
  which reads gloo, takes a member's own completions only.

Pure and torch-free; linear in members.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Pos", "completed_anywhere", "entered", "reached", "never_entered", "open_seq"]

K = TypeVar("K")


@dataclass
class Pos:
    """One member's position on one group's collective sequence (None: not known)."""

    enqueued: int | None
    completed: int | None
    started: int | None = None


def completed_anywhere(pos: Mapping[K, Mapping[int, Pos]]) -> dict[K, int]:
    """Per group, the last collective any member completed (-1: none): on NCCL every member
    entered it."""
    return {k: max((p.completed for p in ps.values() if p.completed is not None), default=-1) for k, ps in pos.items()}


def entered(p: Pos | None, seq: int) -> bool:
    """Whether the member at position `p` entered (or passed) the op at `seq`. No position: no
    dump or snapshot, or nothing recorded on the group (an only-active dump of a rank with
    nothing pending there): had it entered `seq` and not completed it, the entry would show."""
    return p is not None and reached(p.enqueued, seq)


def reached(enqueued: int | None, seq: int) -> bool:
    """`entered` on the enqueued count alone (the live graph keeps only that per group)."""
    return enqueued is not None and enqueued >= seq


def never_entered(members: Iterable[int], ps: Mapping[int, Pos], seq: int, lost: Container[int] = ()) -> list[int]:
    """The members of a group that never entered its op at `seq` (the lost ones among them):
    the only ranks that op can blame."""
    return [m for m in members if m in lost or not entered(ps.get(m), seq)]


def open_seq(p: Pos, floor: int = -1) -> int | None:
    """The oldest op the member at `p` holds open on the group: the first sequence number past
    its own completions and past `floor` (what the group is known to have completed), if it
    enqueued that far; None: nothing open."""
    if p.enqueued is None:
        return None
    first = max(-1 if p.completed is None else p.completed, floor) + 1
    return first if first <= p.enqueued else None
