"""A group's members as arithmetic runs (`0+32x512,7`): short on the wire and in a log for the
regular groups of a mesh (every 32nd rank, a block of 8), exact for any other list."""

from __future__ import annotations

__all__ = ["MAX_MEMBERS", "decode_members", "encode_members"]


def encode_members(members: list[int]) -> str:
    """`0+32x512,7`: runs of `start+step x count`, single ranks as themselves, in order."""
    out: list[str] = []
    i, n = 0, len(members)
    while i < n:
        if i + 2 < n and members[i + 1] - members[i] == members[i + 2] - members[i + 1] > 0:
            step = members[i + 1] - members[i]
            j = i + 2
            while j + 1 < n and members[j + 1] - members[j] == step:
                j += 1
            out.append(f"{members[i]}+{step}x{j - i + 1}")
            i = j + 1
        else:
            out.append(str(members[i]))
            i += 1
    return ",".join(out)


MAX_MEMBERS = 1 << 20
"""The most members a label may name: a corrupt or hostile run ('0+1x10000000000') stops there."""


def decode_members(spec: str) -> list[int]:
    """The members `encode_members` wrote; ValueError for anything it cannot have written."""
    out: list[int] = []
    for part in spec.split(","):
        if "+" in part:
            start, rest = part.split("+", 1)
            step, count = (int(x) for x in rest.split("x", 1))
            if step <= 0 or count < 0 or len(out) + count > MAX_MEMBERS:
                raise ValueError(f"not a run of members: {part[:40]!r}")
            out.extend(range(int(start), int(start) + step * count, step))
        elif part:
            out.append(int(part))
    return out
