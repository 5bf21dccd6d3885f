"""What the check's writer shares through the job's store for the other nodes' copies of its
report, so that no value is over PART_BYTES and all nodes fetching it cost the store a bounded
total (issue 21 item 4: at ~4.7k ranks the report alone was over the store's 8 MiB per-value
limit, and rank 0 raised while publishing the verdict; N/8 nodes fetching an O(N) report is
O(N^2) bytes).

The writer publishes under `report` a small head: the verdict (exit code, verdict, outcome, a
short summary), where the full report was written (host, node, path), and - while the full
report times the number of other nodes stays under SHARE_TOTAL_BYTES (every job of a few
nodes, where each node's gate wants the whole report) - the report itself in `report/part/I`
values of at most PART_BYTES, set before the head. A larger job's other nodes write the
verdict-only copy (`verdict_only`), which says where the full report is.
"""

from __future__ import annotations

import json
from typing import Any

from distdiag.runtime.exchange import BATCH, Exchange, bounded

__all__ = ["PART_BYTES", "SHARE_TOTAL_BYTES", "SUMMARY_CHARS", "share_report", "read_shared", "verdict_only"]

PART_BYTES = 60 * 1024
"""The largest value set: under the 64 KB distdiag keeps every store value to."""
SHARE_TOTAL_BYTES = 256 * 2**20
"""What all other nodes fetching the full report may cost the store together."""
SUMMARY_CHARS = 2000


def share_report(ex: Exchange, text: str, *, host: str, node: int, nodes: int, where: str | None) -> bool:
    """Publish the report's head (and the report in parts when the job is small enough);
    True when the full report was shared."""
    data = json.loads(text)
    head: dict[str, Any] = {
        "exit_code": data.get("exit_code"), "verdict": data.get("verdict"), "outcome": data.get("outcome"),
        "summary": str(data.get("summary", ""))[:SUMMARY_CHARS], "world_size": data.get("world_size"),
        "written_by": data.get("written_by"), "created": data.get("created", ""),
        "host": host, "node": node, "where": where, "parts": 0,
    }
    size = len(text.encode())
    full = size * max(nodes - 1, 1) <= SHARE_TOTAL_BYTES
    if full:
        # by characters: PART_BYTES of them are PART_BYTES bytes in ASCII (what json.dumps
        # writes by default), a quarter of that is at most PART_BYTES in any UTF-8
        step = PART_BYTES if text.isascii() else PART_BYTES // 4
        parts = [text[i : i + step] for i in range(0, len(text), step)]
        for index, part in enumerate(parts):
            with bounded("set report/part"):
                ex.store.set(f"report/part/{index}", part)
        head["parts"] = len(parts)
    ex.publish("report", head)
    return full


def read_shared(ex: Exchange) -> dict[str, Any] | None:
    """The writer's head, with `json` (the full report's text) when it was shared in full;
    None when nothing was shared."""
    head = ex.read("report")
    if not head:
        return None
    count = int(head.get("parts") or 0)
    if count:
        text = []
        for start in range(0, count, BATCH):
            keys = [f"report/part/{i}" for i in range(start, min(start + BATCH, count))]
            with bounded("multi_get report/part"):
                text += [bytes(v).decode() for v in ex.store.multi_get(keys)]
        head["json"] = "".join(text)
    return head


def verdict_only(head: dict[str, Any], launch_id: str) -> dict[str, Any]:
    """A node's copy when the full report was not shared: the verdict, and where the full
    report is (a valid report: the node's launcher takes its exit code from it)."""
    where = head.get("where") or "(not written)"
    summary = f"{head.get('summary', '')} (this node's copy has the verdict only: the full report is on host " \
              f"{head.get('host')} (node {head.get('node')}) at {where})"
    from distdiag.report.model import Report

    report = Report(
        world_size=max(int(head.get("world_size") or 1), 1), exit_code=int(head.get("exit_code", 3)),
        verdict=head.get("verdict") or "fail", outcome=head.get("outcome") or "completed", summary=summary,
        written_by=int(head.get("written_by") or 0), created=head.get("created", ""), launch_id=launch_id,
    )
    return report.to_dict()
