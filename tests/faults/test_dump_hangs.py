"""`distdiag hang-report DIR` on dumps torch itself wrote: a real 4-rank gloo job with dp, tp and
P2P groups (tests/faults/dump_workers.py), one rank stalled on the host, and its healthy twin.

torch 2.13 on gloo writes version-2.10 pickles with Python frames, `pg_id` per process, no
membership in pg_config, and pg_status keyed by pg_id: the reader must still find the groups
by their members, name the stalled rank, and show every group's ops.
"""

from __future__ import annotations

import json
import pickle

import pytest
from typer.testing import CliRunner

from distdiag.cli import app
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(180)


def _run(tmp_path, fault):
    result = run_ranks(4, [f"fault={fault}", "rank=3"], tmp_path, entry="tests.faults.dump_workers:job",
                       env={"TORCH_FR_BUFFER_SIZE": "2000"}, timeout=90)
    assert not result.timed_out and result.codes == [0, 0, 0, 0], [o.stderr[-2000:] for o in result.outcomes]
    return tmp_path


@pytest.fixture(scope="module")
def stalled(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("stall"), "stall")


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("healthy"), "none")


def _report(path, *extra):
    out = CliRunner().invoke(app, ["hang-report", str(path), "--format", "json", "--exit-code", *extra])
    return out.exit_code, json.loads(out.output) if out.output.startswith("{") else out.output


def test_torch_writes_what_the_reader_expects(stalled):
    """The facts the reader relies on, seen in torch's own dump: a pickle with tuples, version 2.10, frames."""
    dump = pickle.loads((stalled / "pickle" / "nccl_trace_rank_0").read_bytes())
    assert dump["version"] == "2.10" and isinstance(dump["entries"][0]["process_group"], tuple)
    assert any(f["filename"].endswith("dump_workers.py") for e in dump["entries"] for f in e["frames"])


@pytest.mark.parametrize("form", ["pickle", "json"])
def test_a_stalled_rank_is_named_from_real_dumps(stalled, form):
    """Rank 3 sleeps instead of its tp all_gather: named, with the group by its members and the op."""
    code, report = _report(stalled / form)
    assert code == 3, report
    findings = report["probes"][0]["findings"]
    blamed = next(f for f in findings if f["ranks"] == [3])
    assert blamed["severity"] == "critical" and "never entered" in blamed["issue"], blamed
    assert "its dump shows it inside no collective; last recorded: all_reduce #2 on ranks[1,3]" in blamed["issue"]
    # nobody else is blamed: rank 2 waits on rank 3 in ranks[2,3], ranks 0-1 in the world
    # all_reduce both never entered; all three are stranded, listed apart with their chains
    assert not any(f["severity"] in ("critical", "error") and set(f["ranks"]) - {3} for f in findings), findings
    stranded = next(f for f in findings if f.get("cause") == "stranded")
    assert stranded["severity"] == "info" and "ranks 0-2 are stranded" in stranded["issue"], stranded
    rows = report["probes"][0]["details"]["table:last op per group and rank (flight-recorder dumps)"]
    groups = {r["group"] for r in rows}
    assert {"world", "ranks[0,2]", "ranks[1,3]", "ranks[0,1]", "ranks[2,3]"} <= groups, groups
    assert all(r["last op"] != "-" and "?" not in r["last op"] for r in rows), rows
    gather = {r["rank"]: r for r in rows if r["group"] == "ranks[2,3]"}
    assert gather[2]["last op"] == "all_gather #2" and gather[2]["sizes"] == "[[4]]" and gather[2]["dtypes"] == "Float"
    assert gather[2]["enqueued/completed"] == "2/1" and gather[3]["enqueued/completed"] == "1/1"
    per_rank = report["probes"][0]["details"]["groups"]
    assert per_rank["2"]["ranks[2,3]"]["op"] == "all_gather" and per_rank["2"]["ranks[2,3]"]["members"] == [2, 3]
    if form == "pickle":  # only the pickle form carries frames: the user's line, not torch's wrapper
        assert "dump_workers.py" in gather[2]["called at"]


def test_healthy_twin_is_silent(healthy):
    """The same job with no stall: no critical finding, exit 0, every group shown with its ops."""
    for form in ("pickle", "json"):
        code, report = _report(healthy / form)
        assert code == 0, report
        assert not [f for f in report["probes"][0]["findings"] if f["severity"] == "critical"]
        rows = report["probes"][0]["details"]["table:last op per group and rank (flight-recorder dumps)"]
        assert len({r["group"] for r in rows}) >= 5


def test_a_rank_without_a_dump_is_a_suspect(stalled, tmp_path):
    """Only ranks 0-2 dumped: gloo's dumps do not say the job has 4 ranks (the report says so);
    with --world-size 4, rank 3 is named lost."""
    for r in range(3):
        (tmp_path / f"nccl_trace_rank_{r}").write_bytes((stalled / "pickle" / f"nccl_trace_rank_{r}").read_bytes())
    code, report = _report(tmp_path)
    assert "pass --world-size N" in report["probes"][0]["findings"][-1]["evidence"]
    code, report = _report(tmp_path, "--world-size", "4")
    lead = report["probes"][0]["findings"][0]
    assert code == 3 and lead["ranks"] == [3] and "no dump file" in lead["issue"]


def test_dumps_passed_as_several_paths_read_as_one_job(stalled, tmp_path):
    """Dumps as users keep them: split over two hosts' folders with a log beside them, or named
    one by one (a shell glob): read as one job, the log skipped with one line, the same verdict."""
    import shutil

    files = sorted((stalled / "pickle").glob("nccl_trace_rank_*"))
    for i, f in enumerate(files):
        host = tmp_path / ("node-a" if i < 2 else "node-b")
        host.mkdir(exist_ok=True)
        shutil.copy(f, host / f.name)
    (tmp_path / "node-a" / "train.log").write_text("step 1 loss 2.3\n")
    for args in ([str(tmp_path / "node-a"), str(tmp_path / "node-b")], [str(f) for f in files]):
        out = CliRunner().invoke(app, ["hang-report", *args, "--format", "json"])
        assert out.exit_code == 3, out.output
        report = json.loads(out.output[out.output.index("{"):])
        assert [f["ranks"] for f in report["probes"][0]["findings"] if f["severity"] == "critical"] == [[3]]
    out = CliRunner().invoke(app, ["hang-report", str(tmp_path / "node-a"), str(tmp_path / "nope")])
    assert out.exit_code == 2 and "nope does not exist" in out.output
