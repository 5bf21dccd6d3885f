"""`distdiag hang-report`: saved reports and flight-recorder dumps (JSON, and pickle read with no globals)."""

from __future__ import annotations

import json
import pickle

from typer.testing import CliRunner

from distdiag.cli import app
from distdiag.report.model import Finding, ProbeResult, Report, write_report


def entry(seq, op="all_reduce", sizes=((16,),), pg="default_pg"):
    return {"collective_seq_id": seq, "profiling_name": f"gloo:{op}", "input_sizes": [list(s) for s in sizes],
            "input_dtypes": ["Float"], "process_group": ["0", pg], "state": "scheduled", "is_p2p": False}


def dump(entries):
    return {"version": "2.10", "pg_config": {}, "entries": entries}


def test_renders_a_saved_watchdog_report(tmp_path):
    probe = ProbeResult.from_findings("watchdog", [Finding("critical", "rank 1 never entered all_reduce #7", ranks=[1])])
    write_report(Report(world_size=2, probes=[probe], exit_code=3, verdict="fail", outcome="hang", written_by=0),
                 tmp_path / "hang-report.json")
    out = CliRunner().invoke(app, ["hang-report", str(tmp_path)])
    assert out.exit_code == 3 and "never entered all_reduce #7" in out.output and "distdiag watchdog" in out.output


def test_json_dumps_name_the_rank_that_stopped_and_a_mismatch(tmp_path):
    (tmp_path / "fr_trace_0").write_text(json.dumps(dump([entry(1), entry(2), entry(3)])))
    (tmp_path / "fr_trace_1").write_text(json.dumps(dump([entry(1), entry(2, op="all_gather")])))
    out = CliRunner().invoke(app, ["hang-report", str(tmp_path), "--format", "json"])
    assert out.exit_code == 3, out.output  # the verdict's code: the dumps show a hang
    data = json.loads(out.output)
    issues = [f["issue"] for f in data["probes"][0]["findings"]]
    assert any("desync" in i and "#2" in i for i in issues)
    assert any("rank 1 never entered all_reduce #3" in i for i in issues)


def test_pickle_dumps_are_read_by_default_and_trust_pickle_is_a_no_op(tmp_path):
    """torch's default format needs no flag; the old --trust-pickle is still accepted (scripts use it)."""
    (tmp_path / "fr_trace_0").write_bytes(pickle.dumps(dump([entry(1)])))
    (tmp_path / "fr_trace_1").write_bytes(pickle.dumps(dump([entry(1)])))
    for extra in ([], ["--trust-pickle"]):
        out = CliRunner().invoke(app, ["hang-report", str(tmp_path), "--exit-zero", *extra])
        assert out.exit_code == 0 and "flight-recorder" in out.output, out.output


def test_missing_or_foreign_input_is_one_line_exit_2(tmp_path):
    out = CliRunner().invoke(app, ["hang-report", str(tmp_path / "nope")])
    assert out.exit_code == 2
    (tmp_path / "junk.txt").write_text("hello")
    out = CliRunner().invoke(app, ["hang-report", str(tmp_path)])
    assert out.exit_code == 2 and "neither JSON nor a pickle" in out.output
