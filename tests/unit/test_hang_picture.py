"""The picture of a hang (`distdiag hang-report --graph`) and the culprit's place as fields: both
drawn from the wait-for analysis the verdict reads, in the live writer's and the dumps' reports."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from distdiag.cli import app
from distdiag.hang.picture import MAX_RANK_NODES, graph_text, to_dot, to_mermaid
from distdiag.report.model import EXIT_HANG, ProbeResult, RankInfo, Report, read_report, verdict_for, write_report
from distdiag.watchdog import writer
from tests.unit.hang_incident import incident
from tests.unit.test_watchdog_cli import dump, entry

EVENT = {"kind": "timeout", "rank": 0, "detail": "no progress for 60s"}


def _report(world: int) -> Report:
    snaps, lost = incident(world, "stall", 0)
    findings, details = writer.analyse_and_detail(EVENT, snaps, lost, {}, world, 60.0)
    result = ProbeResult.from_findings("watchdog", findings, details=details)
    ranks = [RankInfo(r, f"node{r // 8:04d}", r // 8, r % 8, "cpu", 100 + r) for r in range(world)]
    return Report(world_size=world, probes=[result], ranks=ranks, exit_code=EXIT_HANG,
                  verdict=verdict_for(EXIT_HANG, [result]), outcome="hang", summary=findings[0].issue)


def test_the_culprit_is_a_red_node_its_waiters_point_at():
    picture = _report(64).probes[0].details["wait_for_graph"]
    kinds = {n["id"]: n["kind"] for n in picture["nodes"]}
    assert kinds["r3"] == "culprit" and list(kinds.values()).count("culprit") == 1, kinds
    assert "load_next_microbatch" in next(n["label"] for n in picture["nodes"] if n["id"] == "r3")
    # its TP peers wait for it directly, in all_reduce #6
    into = {e["src"] for e in picture["edges"] if e["dst"] == "r3"}
    assert {"r0", "r1", "r2", "r4", "r5", "r6", "r7"} <= into, picture["edges"]
    dot = to_dot(picture)
    assert dot.startswith("digraph wait_for {") and 'r0 -> r3 [label="all_reduce #6' in dot
    assert 'r3 [label="rank 3\\n' in dot and 'color="#cc0000"' in dot
    mermaid = to_mermaid(picture)
    assert mermaid.startswith("flowchart LR\n") and "r0 -->|" in mermaid and "class r3 culprit" in mermaid
    assert '"' not in mermaid.replace('["', "").replace('"]', "").replace('("', "").replace('")', "").replace(
        '|"', "").replace('"|', "").replace('{"', "").replace('"}', "")  # labels' quotes escaped


def test_at_scale_stranded_ranks_are_one_node_per_end():
    picture = _report(1024).probes[0].details["wait_for_graph"]
    assert len(picture["nodes"]) < 10 and picture["note"], picture
    stranded = [n for n in picture["nodes"] if n["kind"] == "ranks"]
    assert stranded and "1023 stranded" in stranded[0]["label"], picture["nodes"]
    assert MAX_RANK_NODES < 1024


def test_culprit_location_as_fields():
    report = _report(64)
    findings = report.probes[0].findings
    located = report.probes[0].details["culprit_locations"]
    assert located, located
    first = located[0]
    assert first["rank"] == 3 and first["file"] == "/job/data.py" and first["line"] == 58
    assert first["function"] == "load_next_microbatch" and first["code"] == "return next(self.iterator)"
    assert "/job/data.py:58" in findings[first["finding"]].issue
    assert all(findings[c["finding"]].cause != "stranded" for c in located)


def test_hang_report_graph_option(tmp_path):
    write_report(_report(64), tmp_path / "hang-report.json")
    for name, head in (("g.dot", "digraph wait_for {"), ("g.gv", "digraph wait_for {"), ("g.mmd", "flowchart LR")):
        out = CliRunner().invoke(app, ["hang-report", str(tmp_path), "--graph", str(tmp_path / name)])
        assert out.exit_code == 3, out.output
        assert (tmp_path / name).read_text().startswith(head)
    bad = CliRunner().invoke(app, ["hang-report", str(tmp_path), "--graph", str(tmp_path / "g.txt")])
    assert bad.exit_code == 2 and "must end in .dot" in bad.output and not (tmp_path / "g.txt").exists()
    # the report read back keeps both (details round-trip)
    back = read_report(tmp_path / "hang-report.json").probes[0].details
    assert back["wait_for_graph"]["nodes"] and back["culprit_locations"][0]["line"] == 58


def test_dumps_graph(tmp_path):
    (tmp_path / "fr_trace_0").write_text(json.dumps(dump([entry(1), entry(2), entry(3)])))
    (tmp_path / "fr_trace_1").write_text(json.dumps(dump([entry(1), entry(2)])))
    out = CliRunner().invoke(app, ["hang-report", str(tmp_path), "--graph", str(tmp_path / "g.mmd")])
    assert out.exit_code == 3, out.output
    text = (tmp_path / "g.mmd").read_text()
    assert "r0 -->" in text and "r1" in text and "class r1 culprit" in text, text


def test_a_report_without_a_graph_says_so(tmp_path):
    write_report(Report(world_size=2, probes=[ProbeResult("watchdog")]), tmp_path / "hang-report.json")
    out = CliRunner().invoke(app, ["hang-report", str(tmp_path), "--graph", str(tmp_path / "g.dot")])
    assert out.exit_code == 0 and "no wait-for graph" in out.output and not (tmp_path / "g.dot").exists()


def test_graph_text_by_suffix():
    picture = {"nodes": [{"id": "r0", "label": 'a "quoted" [x]', "kind": "culprit"}], "edges": [], "note": ""}
    assert 'label="a \\"quoted\\" [x]"' in graph_text(picture, "x.DOT")
    assert "#34;quoted#34;" in graph_text(picture, "x.mmd")
