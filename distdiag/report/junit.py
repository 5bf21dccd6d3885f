"""The verdict as JUnit XML, for CI systems and schedulers that show test results.

One <testsuite> named for the command (`distdiag.check`, `distdiag.hang-report`,
`distdiag.analyze`, `distdiag.watch`); a <testcase> per probe (failed: <failure>, raised or
hung: <error>, skipped: <skipped>) and a <testcase> per node (classname "distdiag.nodes"),
failed when a finding says to take that node out, so a scheduler's UI shows which node to
drain without reading the JSON. Written atomically, like the report.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path

from distdiag.report.model import Finding, Report, Severity, Status, group_by_node, write_json_atomic
from distdiag.report.render import format_ranks

__all__ = ["junit_xml", "write_junit"]


def _finding_text(f: Finding, world: int) -> str:
    lines = [f"[{f.severity}] {format_ranks(f.ranks, world)}: {f.issue}"]
    if f.evidence:
        lines.append(f"  evidence: {f.evidence}")
    if f.fix:
        lines.append(f"  fix: {f.fix}")
    if f.drain:
        lines.append("  DRAIN: " + ", ".join(f"{k}={v}" for k, v in f.drain.items()))
    return "\n".join(lines)


def junit_xml(report: Report, suite_name: str = "distdiag.check") -> str:
    """The report as a JUnit XML document (a string); `suite_name`: the command's suite."""
    suites = ET.Element("testsuites", name="distdiag")
    suite = ET.SubElement(
        suites, "testsuite", name=suite_name, timestamp=report.created, time=f"{report.duration_s:.3f}"
    )
    props = ET.SubElement(suite, "properties")
    for key, value in (
        ("verdict", report.verdict), ("exit_code", report.exit_code), ("outcome", report.outcome),
        ("world_size", report.world_size), ("summary", report.summary), ("schema", report.schema),
        ("distdiag_version", report.distdiag_version), ("torch_version", report.torch_version),
    ):
        ET.SubElement(props, "property", name=key, value=str(value))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    world = report.world_size
    for probe in report.probes:
        case = ET.SubElement(suite, "testcase", classname="distdiag.probes", name=probe.name, time=f"{probe.duration_s:.3f}")
        counts["tests"] += 1
        bad = [f for f in probe.findings if f.severity in (Severity.ERROR, Severity.CRITICAL)]
        text = "\n".join(_finding_text(f, world) for f in probe.findings)
        if probe.status == Status.SKIP:
            ET.SubElement(case, "skipped", message=probe.reason or "skipped")
            counts["skipped"] += 1
        elif probe.status in (Status.FAIL, Status.ERROR):
            tag = "error" if probe.status == Status.ERROR or any(f.severity == Severity.CRITICAL for f in bad) else "failure"
            head = bad[0].issue if bad else (probe.reason or probe.status)
            node = ET.SubElement(case, tag, message=head[:500], type=probe.status)
            node.text = text
            counts["errors" if tag == "error" else "failures"] += 1
        elif text:
            ET.SubElement(case, "system-out").text = text
    for group in group_by_node(report)["nodes"]:
        name = f"node {group['node']} ({group['host']})"
        case = ET.SubElement(suite, "testcase", classname="distdiag.nodes", name=name, time="0")
        counts["tests"] += 1
        drains = [f for f in group["findings"] if f.get("drain")]
        if drains:
            node = ET.SubElement(case, "failure", message=f"take {name} out: {drains[0]['issue']}"[:500], type="drain")
            node.text = "\n".join(f"[{f['probe']}] {f['issue']}" for f in drains)
            counts["failures"] += 1
    for key, value in counts.items():
        suite.set(key, str(value))
        suites.set(key, str(value))
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode")


def write_junit(report: Report, path: str | os.PathLike[str], suite_name: str = "distdiag.check") -> Path:
    """Write the JUnit XML atomically (readers see the old file or the new one)."""
    return write_json_atomic(path, junit_xml(report, suite_name))
