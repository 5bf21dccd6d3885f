"""Host names in Slurm's hostlist syntax (`node[0005-0007,0127]`), which `scontrol show
hostnames` expands back to the names: the form a scheduler reads (render.format_hosts is the
short form for people: 'node[0004-2044 step 4]'). A leaf: the model writes the report's
`hostlist` with it, the text shows it beside the short form."""

from __future__ import annotations

import re

__all__ = ["slurm_hostlist"]

_HOST_NUM = re.compile(r"^(.*?)(\d+)$")


def _ranges(nums: list[int], width: int) -> str:
    """Sorted distinct numbers as '0005-0007,0127' (zero-padded to `width`)."""
    spans: list[list[int]] = []
    for n in nums:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ",".join(f"{a:0{width}d}" if a == b else f"{a:0{width}d}-{b:0{width}d}" for a, b in spans)


_SLURM_SAFE = re.compile(r"^[A-Za-z0-9._-]+$")


def slurm_hostlist(hosts: list[str]) -> str:
    """Host names in Slurm's hostlist syntax, which `scontrol show hostnames` expands back to
    exactly these names: node0005..node0007, node0127 -> 'node[0005-0007,0127]'.

    Names are grouped by the text before their trailing number and that number's width, so
    zero padding survives ('node08' and 'node9' stay apart: 'node08,node9', never a range
    that would read as node09); a group of one is written bare. A name without a trailing
    number, or with characters a hostlist gives a meaning to (brackets, commas), is written as
    it is. Every number is written out (no 'step', no 'every'): longer than `format_hosts`
    on regular sets, but a scheduler reads it."""
    groups: dict[tuple[str, int], list[int]] = {}
    out: list[tuple[str, int, str]] = []
    for h in sorted(set(hosts)):
        m = _HOST_NUM.match(h) if _SLURM_SAFE.match(h) else None
        if m is None:
            out.append((h, -1, h))
            continue
        digits = m.group(2)
        # an unpadded number's width is its own: 'node9' and 'node10' are one group of width 0
        width = len(digits) if digits.startswith("0") and len(digits) > 1 else 0
        groups.setdefault((m.group(1), width), []).append(int(digits))
    for stem in [k[0] for k in groups if k[1] == 0]:  # 'node10' beside 'node08': one group of width 2
        for n in list(groups[(stem, 0)]):
            if (stem, len(str(n))) in groups and len(str(n)) > 1:
                groups[(stem, len(str(n)))].append(n)
                groups[(stem, 0)].remove(n)
        if not groups[(stem, 0)]:
            del groups[(stem, 0)]
    for (stem, width), nums in groups.items():
        nums = sorted(set(nums))
        if len(nums) == 1:
            out.append((stem, width, f"{stem}{nums[0]:0{width}d}"))
            continue
        out.append((stem, width, f"{stem}[{_ranges(nums, width)}]"))
    return ",".join(text for _stem, _width, text in sorted(out))
