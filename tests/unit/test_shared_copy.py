"""The report's copy for the other hosts (issue 21 items 1 and 4): no store value over 64 KB,
the whole report while the job is small, a cut copy that says where the full one is beyond.
A real TCPStore in this process; reports built by the check's own build_report."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch.distributed as dist

from distdiag.check.consolidate import build_report
from distdiag.report.model import Finding, ProbeResult, RankInfo, read_report, write_json_atomic
from distdiag.runtime.exchange import Exchange
from distdiag.runtime.incident import Incident
from distdiag.runtime.keys import IncidentKeys


class Sizes:
    """The real client, recording the size of every value set."""

    def __init__(self, store):
        self.store = store
        self.sizes: list[int] = []

    def set(self, key, value):
        self.sizes.append(len(value.encode() if isinstance(value, str) else value))
        return self.store.set(key, value)

    def __getattr__(self, name):
        return getattr(self.store, name)


@pytest.fixture
def incident(request):
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    client = Sizes(dist.PrefixStore(request.node.name, server))
    return Incident(Exchange(client, 0, 2), IncidentKeys(), 2)


def _report(world: int) -> str:
    return _report_object(world).to_json()


def _report_object(world: int):
    ranks = [RankInfo(r, f"node{r // 8:04d}", r // 8, r % 8, f"cuda:{r % 8}", 1000 + r) for r in range(world)]
    finding = Finding(severity="error", issue=f"rank 5 is 40% slower than the median of {world} ranks", evidence="x" * 200,
                      ranks=[5], fix="look at rank 5's host")
    rows = [{"rank": r, "host": ranks[r].host, "gbps": 180.0} for r in range(world)]
    probe = ProbeResult.from_findings("bandwidth", [finding], details={"table:ranks": rows}, duration_s=1.0)
    report = build_report(world_size=world, ranks=ranks, probes=[probe], not_run=[], outcome="completed", hung=False,
                          restart_count=0, run_id="r", duration_s=1.0, config={}, written_by=0)
    assert report.exit_code == 1
    return report


def test_a_small_job_shares_the_whole_report_in_chunks_under_64kb(incident):
    text = _report(2000)
    assert len(text) > 4 * 64 * 1024  # several chunks
    shared = incident.shared_copy(text, "/tmp/r.json", "node0000", readers=249)
    assert shared == text
    incident.publish_report(shared, {"host": "node0000"})
    assert max(incident.ex.store.sizes) <= 64 * 1024
    assert incident.read_report()[0] == text


def test_a_large_job_shares_a_valid_cut_copy_saying_where_the_report_is(incident, tmp_path):
    text = _report(4096)
    shared = incident.shared_copy(text, "/runs/r.json", "node0000", readers=2047)  # 16k ranks: 2048 nodes
    assert len(shared.encode()) * 2047 <= 256 * 2**20 < len(text.encode()) * 2047
    incident.publish_report(shared, {"host": "node0000"})
    assert max(incident.ex.store.sizes) <= 64 * 1024
    copy = tmp_path / "copy.json"
    write_json_atomic(str(copy), incident.read_report()[0])
    report = read_report(str(copy))  # a valid report: the node's launcher reads its code from it
    assert report.exit_code == 1 and report.verdict == "fail"
    finding = report.probes[0].findings[0]
    assert "rank 5 is 40% slower" in finding.issue, "the findings stay; the per-rank tables go"
    assert "the full report is on host node0000 at /runs/r.json" in json.dumps(report.probes[0].details)


def test_a_report_in_any_script_stays_under_the_limit(incident):
    text = json.dumps({"schema": "distdiag.report/1", "exit_code": 0, "summary": "ok", "notes": "\u00e9\u4e2d" * 90_000},
                      ensure_ascii=False)
    incident.publish_report(incident.shared_copy(text, "/r.json", "h"), {"host": "h"})
    assert max(incident.ex.store.sizes) <= 64 * 1024 and incident.read_report()[0] == text


def test_the_cut_copy_made_from_the_report_is_the_one_made_from_its_json(incident):
    """The writers hand over the Report they serialised: its cut copy is built without parsing
    the JSON back (1-3 s for a 16k-rank report), and is the same copy."""
    report = _report_object(4096)
    text = report.to_json()
    parsed = json.loads(incident.shared_copy(text, "/runs/r.json", "node0000", readers=2047))
    built = json.loads(incident.shared_copy(text, "/runs/r.json", "node0000", readers=2047, report=report))
    assert built == parsed and built["probes"][0]["details"]["note"].endswith("/runs/r.json")
    assert report.probes[0].details, "the writer's own report keeps its details"
