"""`distdiag hang-report DIR` on flight-recorder dumps of versions 2.2 to 2.10, and on files that
are not dumps (one line, exit 2, nothing run, no traceback, no runaway memory).

The older versions come from torch's documented samples (tests/unit/fr_fixtures/, each file
says its source); the dumps torch 2.13 itself writes are read in tests/faults/test_dump_hangs.py.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
from typer.testing import CliRunner

from distdiag.cli import app

FIXTURES = Path(__file__).parent / "fr_fixtures"
VERSIONS = ["2_2", "2_3", "2_4", "2_5", "2_6", "2_7", "2_8", "2_10"]


def _as_torch_pickles(dumps):
    """The pickle torch writes: process_group a tuple (name, desc)."""
    out = {}
    for rank, dump in dumps.items():
        d = json.loads(json.dumps(dump))
        for e in d["entries"]:
            e["process_group"] = tuple(e["process_group"])
        out[rank] = pickle.dumps(d)
    return out


def _write(tmp_path, name, form):
    dumps = json.loads((FIXTURES / f"v{name}.json").read_text())["dumps"]
    folder = tmp_path / form
    folder.mkdir()
    blobs = _as_torch_pickles(dumps) if form == "pickle" else {r: json.dumps(d).encode() for r, d in dumps.items()}
    for rank, blob in blobs.items():
        (folder / f"nccl_trace_rank_{rank}").write_bytes(blob)
    return folder


def _report(path, *extra):
    out = CliRunner().invoke(app, ["hang-report", str(path), "--format", "json", "--exit-code", *extra])
    assert out.output.startswith("{"), out.output
    return out.exit_code, json.loads(out.output)["probes"][0]


def _one_line_exit_2(path, words, *extra):
    out = CliRunner().invoke(app, ["hang-report", str(path), *extra])
    text = out.output.strip()
    assert out.exit_code == 2 and "\n" not in text and "Traceback" not in text, out.output
    assert words in text, text
    return text


@pytest.mark.parametrize("form", ["pickle", "json"])
@pytest.mark.parametrize("version", VERSIONS)
def test_every_dump_version_names_the_rank_that_never_entered(tmp_path, version, form):
    """2 ranks; rank 1 recorded two all_reduces, rank 0 is inside the third."""
    code, probe = _report(_write(tmp_path, version, form))
    lead = probe["findings"][0]
    assert code == 3 and lead["ranks"] == [1] and "never entered all_reduce #3 on world" in lead["issue"], lead
    assert f"dump version {version.replace('_', '.')}" in probe["findings"][-1]["issue"]


@pytest.mark.parametrize("form", ["pickle", "json"])
def test_multi_group_nccl_dumps_are_keyed_by_members(tmp_path, form):
    """Issue 22's case: pg_id per process, pg_config by name, pg_status by pg_id, a P2P-only group,
    string sequence ids, rank 3 stalled on the host with empty entries."""
    code, probe = _report(_write(tmp_path, "2_9_multigroup", form))
    assert code == 3
    critical = [f for f in probe["findings"] if f["severity"] == "critical"]
    assert any(f["ranks"] == [3] and "its dump holds no entries: nothing in flight" in f["issue"] for f in critical), critical
    assert not any(set(f["ranks"]) & {0, 1} for f in critical), critical  # they only wait
    rows = probe["details"]["table:last op per group and rank (flight-recorder dumps)"]
    by = {(r["group"], r["rank"]): r for r in rows}
    tp23 = "ranks[2,3] (TENSOR_MODEL_PARALLEL_GROUP)"
    assert by[(tp23, 2)]["last op"] == "all_reduce #5" and by[(tp23, 2)]["sizes"] == "[[1024, 512]]"
    assert by[(tp23, 2)]["dtypes"] == "Float" and by[(tp23, 2)]["enqueued/completed"] == "5/4"
    pp02 = "ranks[0,2] (PIPELINE_MODEL_PARALLEL_GROUP)"
    assert by[(pp02, 0)]["last op"] == "send to 2 #5 (p2p)" and by[(pp02, 2)]["last op"] == "recv from 0 #4 (p2p)"
    assert by[(pp02, 0)]["enqueued/completed"] == "5/4"  # pg_status of a P2P group counts the p2p sequence
    assert by[(tp23, 3)]["last op"] == "-" and by[(tp23, 3)]["enqueued/completed"] == "?/?"  # empty entries
    assert not any("?" in r["last op"] for r in rows if r["rank"] != 3)
    assert any("rank 3 recorded no entries" in f["evidence"] for f in probe["findings"] if f["severity"] == "info")
    groups = probe["details"]["groups"]["0"]
    assert groups[pp02] == {**groups[pp02], "members": [0, 2], "desc": "PIPELINE_MODEL_PARALLEL_GROUP", "p2p": True,
                            "op": "send", "seq": 5, "peer": 2}


class _Boom:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_malicious_pickle_is_refused_and_nothing_runs(tmp_path):
    """A 'dump' whose unpickling would call os.system: one line, exit 2, the command never ran."""
    marker = tmp_path / "ran"
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "nccl_trace_rank_0").write_bytes(pickle.dumps({"version": "2.10", "entries": [_Boom(marker)]}))
    text = _one_line_exit_2(tmp_path / "d", "refused before anything ran")
    assert "system" in text and not marker.exists()
    _one_line_exit_2(tmp_path / "d", "refused before anything ran", "--trust-pickle")  # the old flag changes nothing
    assert not marker.exists()


@pytest.mark.parametrize("name", ["nccl_trace_1732493000", "trace_rank_99999999", "dump.json"])
def test_a_file_name_that_holds_no_rank_is_one_line(tmp_path, name):
    """A timestamp or pid where the rank goes, or no number: refused, not read as rank 1732493000."""
    (tmp_path / name).write_text(json.dumps({"version": "2.10", "entries": []}))
    _one_line_exit_2(tmp_path, "cannot tell which rank wrote")


BAD = {
    "huge-rank": ({"rank": 10 ** 12, "entries": []}, "'rank' must be an integer from 0"),
    "rank-str": ({"rank": "zero", "entries": []}, "'rank' must be an integer"),
    "huge-members": ({"pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 5000000000]"}},
                      "entries": []}, "no job has"),
    "config-list": ({"pg_config": [1, 2], "entries": []}, "'pg_config' must be an object"),
    "ranks-int": ({"pg_config": {"0": {"ranks": 5}}, "entries": []}, "ranks must be a list or a string"),
    "status-str": ({"pg_status": {"0": {"last_enqueued_collective": "x"}}, "entries": []}, "must be an integer"),
    "sizes-str": ({"entries": [{"collective_seq_id": 1, "input_sizes": "big"}]}, "input_sizes must be a list of shapes"),
    "dtypes-int": ({"entries": [{"collective_seq_id": 1, "input_dtypes": 3}]}, "input_dtypes must be a list"),
    "state-int": ({"entries": [{"collective_seq_id": 1, "state": 2}]}, "state must be a string"),
    "version-list": ({"version": [2, 10], "entries": []}, "'version' must be a string"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_wrong_field_types_are_one_line(tmp_path, case):
    dump, words = BAD[case]
    (tmp_path / "nccl_trace_rank_0").write_text(json.dumps(dump))
    _one_line_exit_2(tmp_path, words)


def test_oversized_and_duplicate_dumps_are_one_line(tmp_path, monkeypatch):
    import distdiag.hang.dumps as dumps

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "trace_0").write_text(json.dumps({"entries": []}))
    (tmp_path / "a" / "trace_0.json").write_text(json.dumps({"entries": []}))
    _one_line_exit_2(tmp_path / "a", "are both dumps of rank 0")
    monkeypatch.setattr(dumps, "MAX_DUMP_BYTES", 8)
    _one_line_exit_2(tmp_path / "a" / "trace_0", "larger than any flight-recorder dump")


def test_empty_entries_everywhere_is_no_crash(tmp_path):
    """Every rank dumped, none recorded anything (e.g. onlyActive dumps of a job that is idle)."""
    for r in range(2):
        (tmp_path / f"nccl_trace_rank_{r}").write_text(json.dumps({"version": "2.10", "pg_status": {}, "entries": []}))
    code, probe = _report(tmp_path)
    assert code == 0 and "rank 0 recorded no entries" in probe["findings"][-1]["evidence"]


def test_a_missing_rank_file_is_a_suspect(tmp_path):
    """The 16-rank-style case in small: pg_config says 4 ranks, rank 2 wrote no dump at all."""
    dumps = json.loads((FIXTURES / "v2_9_multigroup.json").read_text())["dumps"]
    for rank in ("0", "1", "3"):
        (tmp_path / f"nccl_trace_rank_{rank}").write_text(json.dumps(dumps[rank]))
    code, probe = _report(tmp_path)
    lead = probe["findings"][0]
    assert code == 3 and lead["ranks"] == [2] and "no dump file" in lead["issue"]
    assert lead["evidence"].startswith("3 dump file(s) given, of ranks 0-1,3; the job has 4 ranks")


def test_two_groups_of_the_same_ranks_stay_apart(tmp_path):
    """A tp group and a P2P group both of ranks 0,1 (both desc 'undefined'): two rows each, told
    apart by torch's group name (global), never merged and never by pg_id (per process)."""
    def e(name, pg_id, op, seq, p2p=False):
        return {"pg_id": pg_id, "process_group": [name, "undefined"], "profiling_name": f"nccl:{op}",
                "collective_seq_id": 0 if p2p else seq, "p2p_seq_id": seq if p2p else 0, "is_p2p": p2p,
                "input_sizes": [[8]], "input_dtypes": ["BFloat16"], "output_sizes": [[8]], "output_dtypes": ["BFloat16"],
                "state": "completed"}
    config = {"3": {"name": "3", "desc": "undefined", "ranks": "[0, 1]"},
              "5": {"name": "5", "desc": "undefined", "ranks": "[0, 1]"}}
    for rank, (tp_id, p2p_id, op) in {0: (1, 2, "send 0->1"), 1: (2, 1, "recv 1<-0")}.items():
        dump = {"version": "2.10", "pg_config": config, "entries": [e("3", tp_id, "all_reduce", 1), e("5", p2p_id, op, 1, True)]}
        (tmp_path / f"nccl_trace_rank_{rank}").write_text(json.dumps(dump))
    code, probe = _report(tmp_path)
    rows = {(r["group"], r["rank"]): r["last op"] for r in probe["details"]["table:last op per group and rank (flight-recorder dumps)"]}
    assert code == 0 and rows == {("world (group 3)", 0): "all_reduce #1", ("world (group 3)", 1): "all_reduce #1",
                                  ("world (group 5)", 0): "send to 1 #1 (p2p)", ("world (group 5)", 1): "recv from 0 #1 (p2p)"}
