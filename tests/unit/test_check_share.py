"""The check's report shared for other nodes' copies (issue 21 item 4): no store value over
64 KB, the full report while the job is small, the verdict and where the report is beyond.
A real store in this process (TCPStore), reports built by the check's own build_report."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch.distributed as dist

from distdiag.check.consolidate import build_report
from distdiag.check.share import PART_BYTES, read_shared, share_report, verdict_only
from distdiag.report.model import Finding, ProbeResult, RankInfo, read_report, write_json_atomic
from distdiag.runtime.exchange import Exchange


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
def ex(request):
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    return Exchange(Sizes(dist.PrefixStore(request.node.name, server)), 0, 2)


def _report(world: int, code: int = 1) -> str:
    ranks = [RankInfo(r, f"node{r // 8:04d}", r // 8, r % 8, f"cuda:{r % 8}", 1000 + r) for r in range(world)]
    finding = Finding(severity="error", issue=f"rank 5 is 40% slower than the median of {world} ranks", evidence="x" * 200,
                      ranks=[5], fix="look at rank 5's host")
    rows = [{"rank": r, "host": ranks[r].host, "gbps": 180.0} for r in range(world)]
    probe = ProbeResult.from_findings("bandwidth", [finding], details={"table:ranks": rows}, duration_s=1.0)
    report = build_report(world_size=world, ranks=ranks, probes=[probe], not_run=[], outcome="completed", hung=False,
                          restart_count=0, run_id="r", duration_s=1.0, config={}, written_by=0)
    assert report.exit_code == code
    return report.to_json()


def test_a_small_job_shares_the_whole_report_in_parts_under_64kb(ex):
    text = _report(2000)
    assert len(text) > 4 * PART_BYTES  # several parts
    assert share_report(ex, text, host="node0000", node=0, nodes=250, where="/tmp/r.json")
    assert max(ex.store.sizes) <= 64 * 1024
    shared = read_shared(ex)
    assert shared["json"] == text and shared["exit_code"] == 1 and shared["where"] == "/tmp/r.json"


def test_a_large_job_shares_the_verdict_and_where_the_report_is(ex, tmp_path):
    text = _report(4096)
    assert not share_report(ex, text, host="node0000", node=0, nodes=2048, where="/runs/r.json")
    assert max(ex.store.sizes) < 4096
    shared = read_shared(ex)
    assert "json" not in shared and shared["exit_code"] == 1 and shared["outcome"] == "completed"
    copy = tmp_path / "copy.json"
    write_json_atomic(str(copy), json.dumps(verdict_only(shared, "abc"), indent=2))
    report = read_report(str(copy))  # a valid report: the node's launcher reads its code and id
    assert report.exit_code == 1 and report.launch_id == "abc" and report.verdict == "fail"
    assert "rank 5 is 40% slower" in report.summary and "on host node0000 (node 0) at /runs/r.json" in report.summary


def test_a_report_in_any_script_stays_under_the_limit(ex):
    text = json.dumps({"schema": "distdiag.report/1", "exit_code": 0, "summary": "ok", "notes": "\u00e9\u4e2d" * 90_000},
                      ensure_ascii=False)
    assert share_report(ex, text, host="h", node=0, nodes=2, where=None)
    assert max(ex.store.sizes) <= PART_BYTES and read_shared(ex)["json"] == text


def test_nothing_shared_reads_as_none(ex):
    assert read_shared(ex) is None
