"""JSON parsed by orjson where it can, by the standard library where it cannot (issue 21).

At 16k ranks the hang report's writer parses ~33 MB of the node leaders' snapshots, and the
check's rank 0 every rank's result of every probe: orjson (a maintained parser in Rust, with
wheels for the platforms torch ships for) reads them 1.5-2x faster than `json.loads`. Where
its stricter grammar refuses what `json.loads` accepts (NaN and Infinity, which the numeric
probes' evidence may hold; text not in UTF-8), the standard parser reads the value. One
difference stays: an integer outside [-2**63, 2**64) reads as a float (no value distdiag posts
has one: ranks, counts, nanosecond clocks, setup_after's 63-bit digests). Without orjson,
`json` alone.

Only parsing: the standard encoder writes NaN as NaN, orjson as null, and the reports keep
what they wrote before. A leaf of the report package: it imports nothing of distdiag.
"""

from __future__ import annotations

import json
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - a platform without its wheel: the standard parser
    orjson = None  # type: ignore[assignment]  # FAST below says which parser runs

__all__ = ["loads", "FAST"]

FAST = orjson is not None
"""Whether orjson parses (False: json.loads alone)."""


def loads(data: bytes | bytearray | str) -> Any:
    """The value of a JSON text, as `json.loads` reads it."""
    if orjson is not None:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass  # NaN or Infinity, another encoding: the standard parser reads those
    return json.loads(data)
