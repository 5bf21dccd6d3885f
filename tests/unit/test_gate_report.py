"""by_node grouping and JUnit XML of a report (pure)."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from distdiag.report.junit import junit_xml
from distdiag.report.model import Finding, ProbeResult, RankInfo, Report, group_by_node


def _report() -> Report:
    ranks = [RankInfo(r, "a" if r < 2 else "b", r // 2, r % 2, "cpu", 10 + r) for r in range(4)]
    probes = [
        ProbeResult.from_findings("gpu", [
            Finding("error", "host b GPU 1: PCIe link degraded to x8", ranks=[3], drain={"host": "b", "device": "0000:18:00.0"}),
            Finding("error", "node 0 (host a): NVML did not load", drain={"host": "a", "device": None}),
        ]),
        ProbeResult.from_findings("bandwidth", [Finding("warning", "slow link between rank 1 and rank 2", ranks=[1, 2])]),
        ProbeResult.from_findings("env", [Finding("info", "job-wide note")]),
        ProbeResult("collectives", status="skip", reason="world too small"),
    ]
    return Report(world_size=4, probes=probes, ranks=ranks, exit_code=4, verdict="fail", created="2026-01-01T00:00:00+00:00")


def test_findings_are_grouped_per_node_with_drains_and_job_wide_ones_apart():
    """A two-node finding splits by node; a rankless drain lands on its host; rankless others are job-wide."""
    grouped = group_by_node(_report())
    a, b = grouped["nodes"]
    assert (a["node"], a["host"], a["ranks"], b["ranks"]) == (0, "a", [0, 1], [2, 3])
    assert [(f["probe"], f["ranks"]) for f in a["findings"]] == [("gpu", []), ("bandwidth", [1])]
    assert [(f["probe"], f["ranks"]) for f in b["findings"]] == [("gpu", [3]), ("bandwidth", [2])]
    assert a["drain"] and b["drain"] and a["worst"] == "error"
    assert b["findings"][0]["drain"]["device"] == "0000:18:00.0"
    assert grouped["job"] == [{"probe": "env", "severity": "info", "issue": "job-wide note"}]
    assert _report().to_dict()["by_node"] == grouped


def test_junit_has_a_case_per_probe_and_per_node():
    """Failed probe -> <failure>, skip -> <skipped>, info-only -> system-out; each drained node fails."""
    root = ET.fromstring(junit_xml(_report()))
    cases = {(c.get("classname"), c.get("name")): c for c in root.iter("testcase")}
    assert cases[("distdiag.probes", "gpu")].find("failure").get("message").startswith("host b GPU 1")
    assert cases[("distdiag.probes", "collectives")].find("skipped").get("message") == "world too small"
    assert "job-wide note" in cases[("distdiag.probes", "env")].find("system-out").text
    assert cases[("distdiag.nodes", "node 1 (b)")].find("failure").get("type") == "drain"
    suite = root.find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("6", "3", "1")  # gpu, node 0, node 1
