"""A process group as reports name it: `GroupId`, its label, and the one parser of labels.

A process group is known by its members (global ranks, the same on every rank), torch's desc
and, only where two groups share both, torch's group name; never by `pg_id`, which torch
counts per process and per backend. Its label is the text snapshots, the wire, the wait-for
graph and every report carry:

    world                      the default group (every rank)
    ranks[0,8,16]              a group by its members, in group-rank order
    ranks[0,2] (DP)            ... with torch's desc where the desc is a name
    ranks[0,2] (DP, group 5)   ... and torch's group name where another group has the same
                               members and desc (a P2P group beside a tp group of its ranks)
    world (gloo)               the live recorder's view of one group on two backends: which one
    group 5                    a group whose members this process could not learn (torch's name,
                               or the recorder's id for it)
    group?                     a group the watchdog's wrapper could not name at all

`parse_label` reads every one of them back (`parse_label(g.label).label == g.label`, where a
desc is not itself of the form 'group NAME'; 'world' comes back without its members). Text that is none of them (a report's short name
'ranks[3-16355 step 32] (512 ranks)', the wrappers' 'p2p', a malformed member list) gives
`UNKNOWN`. The one behaviour on a label that does not list its members ('group 5', 'group?',
`UNKNOWN`): `members` is None and `ranks(world)` returns None; 'world' gives every rank. What
an unknown group means is the caller's to say: the rules count the ranks that show the group,
the wait-for graph gives the wait no members (it blames nobody), the writer fetches no
history for it, the stall check samples its peers among every rank (any may be a member),
the step-mark comparison skips it. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property, lru_cache

__all__ = ["GroupId", "UNKNOWN", "WORLD", "parse_label", "group_members", "members_label", "shown_desc"]

WORLD = "world"
_RANKS = "ranks["
_NAMED = "group "
_UNNAMED = "group?"
_PLACEHOLDER_DESCS = ("", "undefined", "default_pg")
"""torch's desc of a group given none, and of the default group: not names, not shown."""


def shown_desc(desc: str) -> str:
    """torch's desc as a label shows it: '' for the placeholders of a group given none."""
    return "" if desc in _PLACEHOLDER_DESCS else desc


def members_label(members: tuple[int, ...] | list[int]) -> str:
    """'ranks[0,8,16]': a group by its members (the label of a `GroupId` with just them)."""
    return _RANKS + ",".join(map(str, members)) + "]"


@dataclass(frozen=True)
class GroupId:
    """One process group, the same on every rank; `label` is how reports name it."""

    members: tuple[int, ...] | None = None
    """Global ranks in group-rank order; None where they are not known."""
    desc: str = ""
    """What the label says of the group after its members: torch's desc ('DP'), or the backend
    where the live recorder sees one group on two ('gloo')."""
    name: str = ""
    """torch's group name where the label shows it: a twin's (same members and desc as another
    group), or a group whose members are not known."""
    world: bool = False
    """The default group: every rank, labelled 'world'."""

    @classmethod
    def of(cls, members: tuple[int, ...], world_size: int, desc: str = "", name: str = "") -> GroupId:
        """A group by its members as torch's dump or this process lists them: 'world' when they are
        every rank in order; torch's placeholder descs ('undefined', 'default_pg') are not shown;
        `name` only for a twin."""
        world = len(members) == world_size and members == tuple(range(world_size))
        return cls(members, shown_desc(desc), name, world)

    @cached_property
    def label(self) -> str:
        """'world', 'ranks[0,2]', 'ranks[0,2] (DP, group 5)', 'group 5', 'group?'."""
        listed = self.world or self.members is not None
        if self.world:
            base = WORLD
        elif self.members is not None:
            base = members_label(self.members)
        else:
            base = _NAMED + self.name if self.name else _UNNAMED
        said = [self.desc] if self.desc else []
        if listed and self.name:
            said.append(_NAMED + self.name)
        return f"{base} ({', '.join(said)})" if said else base

    def ranks(self, world_size: int) -> list[int] | None:
        """Its global ranks: the members, every rank for 'world', None when not known."""
        if self.members is not None:
            return list(self.members)
        return list(range(world_size)) if self.world else None

    def qualified(self, word: str) -> GroupId:
        """The same group with `word` said after its desc ('ranks[0,1] (gloo)')."""
        return replace(self, desc=f"{self.desc}, {word}" if self.desc else word)


UNKNOWN = GroupId()
"""What `parse_label` gives for text that is no group label: members not known, label 'group?'."""


@lru_cache(maxsize=1 << 16)  # a label per group: 16k ranks of TP=8 x PP=4 have 6k groups
def parse_label(label: str) -> GroupId:
    """The group a label names (any form this module writes); `UNKNOWN` for other text. Never
    raises. Members are read as listed ('ranks[0, 2]' too), not sorted."""
    base, paren, said = label.partition(" (")
    if paren:
        if not said.endswith(")"):
            return UNKNOWN
        said = said[:-1]
    if base == WORLD:
        return GroupId(desc=said, world=True)
    if base == _UNNAMED:
        return GroupId(desc=said)
    if base.startswith(_NAMED):
        return GroupId(desc=said, name=base[len(_NAMED):])
    if not (base.startswith(_RANKS) and base.endswith("]")):
        return UNKNOWN
    try:
        members = tuple([int(x) for x in base[len(_RANKS):-1].split(",") if x.strip()])  # a list first: faster
    except ValueError:
        return UNKNOWN
    desc, name = said, ""
    if said.startswith(_NAMED):
        desc, name = "", said[len(_NAMED):]
    elif ", " + _NAMED in said:
        desc, name = said.rsplit(", " + _NAMED, 1)
    return GroupId(members, desc, name)


def group_members(label: str, world: int) -> list[int] | None:
    """The global ranks of the group a label names; None when the label does not list them
    (`GroupId.ranks`)."""
    return parse_label(label).ranks(world)
