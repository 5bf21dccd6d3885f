"""docs/report-schema.json on reports of the check's own runs (forked ranks, gloo, real
store), healthy and hung; the hung one is drawn (`hang-report --graph`) and its culprit located
(tests/unit/test_report_schema_doc.py holds the validator and the synthetic reports)."""

from __future__ import annotations

import json

import pytest

from tests.unit.test_report_schema_doc import SCHEMA, problems


@pytest.mark.timeout(150)
def test_real_check_runs_follow_the_schema_and_a_hang_is_drawn(tmp_path):
    """The check's own runs (forked ranks, gloo): a healthy one, and one where rank 1 hangs
    outside the collective: both reports hold to the schema; the hang's report carries the
    wait-for graph (rank 1 red, its peers pointing at it) and rank 1's place as fields."""
    from typer.testing import CliRunner

    from distdiag.cli import app
    from tests.harness import run_check

    healthy = run_check(2, ["--probes", "env,collectives"], tmp_path / "ok", timeout=60)
    assert healthy.codes == [0, 0], healthy.stderr
    assert problems(json.loads((tmp_path / "ok" / "distdiag-report.json").read_text()), SCHEMA) == []
    hung = run_check(3, ["--probes", "env,collectives", "--timeout-s", "4"], tmp_path / "hang",
                     inject="hang:collectives:1", timeout=60)
    assert hung.codes == [3, 3, 3], hung.stderr
    path = tmp_path / "hang" / "distdiag-report.json"
    data = json.loads(path.read_text())
    assert problems(data, SCHEMA) == []
    details = next(p for p in data["probes"] if p["name"] == "collectives")["details"]
    kinds = {n["id"]: n["kind"] for n in details["wait_for_graph"]["nodes"]}
    assert kinds.get("r1") == "culprit", details["wait_for_graph"]
    assert {e["src"] for e in details["wait_for_graph"]["edges"] if e["dst"] == "r1"} == {"r0", "r2"}
    located = [c for c in details["culprit_locations"] if c["rank"] == 1]
    assert located and located[0]["file"].endswith("faults.py") and located[0]["line"] > 0, details["culprit_locations"]
    out = CliRunner().invoke(app, ["hang-report", str(path), "--graph", str(tmp_path / "hang.dot")])
    assert out.exit_code == 3 and "r0 -> r1" in (tmp_path / "hang.dot").read_text(), out.output
    try:
        import matplotlib  # noqa: F401 - the image needs the plot extra; the rest of the test does not
    except ImportError:
        return
    from tests.cli.test_pictures import assert_sane_png

    out = CliRunner().invoke(app, ["hang-report", str(path), "--graph", str(tmp_path / "hang.png")])
    assert out.exit_code == 3, out.output
    assert_sane_png(tmp_path / "hang.png")
