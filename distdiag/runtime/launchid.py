"""The launch id: the id distdiag's launcher (`distdiag check`, `gate`, `watch`) gives its ranks
through the environment (DISTDIAG_LAUNCH_ID). Every report a rank writes carries it
(`launch_id`), and each node's launcher takes only a report that carries its own: the incident's
writer stamps its report with it, and each other node's copy with that node's
(distdiag/runtime/incident.py). Standard library only: the launcher's ranks import it before
torch.
"""

from __future__ import annotations

import json
import os

__all__ = ["LAUNCH_ID_ENV", "launch_id", "with_this_launch_id"]

LAUNCH_ID_ENV = "DISTDIAG_LAUNCH_ID"


def launch_id() -> str:
    """This process's launch id ('' when no distdiag launcher started it)."""
    return os.environ.get(LAUNCH_ID_ENV, "")


def with_this_launch_id(text: str) -> str:
    """A report's JSON, written on another node, as this node's copy: with this node's launch id
    (each node's launcher takes only a report carrying its own; the copy came with the writer's).
    Unchanged without a launcher, and laid out as it came (indented or one line)."""
    mine = launch_id()
    if not mine:
        return text
    try:
        data = json.loads(text)
    except ValueError:
        return text
    if not isinstance(data, dict) or data.get("launch_id") == mine:
        return text
    data["launch_id"] = mine
    return json.dumps(data, indent=2 if text.startswith("{\n") else None)
