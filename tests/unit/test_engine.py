"""torch's flight recorder as distdiag reads it: NCCL-format dumps, older versions, degraded states.

No GPU here: NCCL's records are fed as dumps in torch's documented format (the flight-recorder
tutorial: `pg_status` with last enqueued / started / completed per group, entries with
`state` scheduled / started / completed). The live gloo path is proven by the real-process
tests in tests/faults/test_engine_hangs.py.
"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from distdiag.cli import app
from distdiag.hang import analyze_hang
from distdiag.hang.recorder import EngineReader, positions_from_dump


def nccl_entry(seq, state="started", op="all_reduce", sizes=((1024,),), pg=("0", "default_pg")):
    return {
        "record_id": seq, "pg_id": 0, "process_group": list(pg), "collective_seq_id": seq, "p2p_seq_id": 0,
        "op_id": seq, "profiling_name": f"nccl:{op}", "time_created_ns": 1_700_000_000_000_000_000 + seq,
        "input_sizes": [list(s) for s in sizes], "input_dtypes": ["Float"], "output_sizes": [list(s) for s in sizes],
        "output_dtypes": ["Float"], "state": state, "time_discovered_started_ns": None,
        "time_discovered_completed_ns": None, "retired": state == "completed", "timeout_ms": 600000, "is_p2p": False,
    }


def nccl_dump(enqueued, started, completed, entries, version="2.5"):
    status = {"last_enqueued_collective": enqueued, "last_completed_collective": completed}
    if started is not None:
        status["last_started_collective"] = started
    return {
        "version": version,
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}},
        "pg_status": {"0": status},
        "entries": entries,
    }


def snaps_of(dumps):
    return {r: {"phase": "training", "stack": [], "recent": [], "engine": positions_from_dump(d)} for r, d in dumps.items()}


def analyse(dumps, world=3):
    return analyze_hang(snaps_of(dumps), {}, {}, world, what="the job", timeout_s=30)


def history(upto, last_state):
    return [nccl_entry(s, "completed") for s in range(1, upto)] + [nccl_entry(upto, last_state)]


def test_every_rank_started_none_completed_is_a_fabric_stall():
    """NCCL with start events: all three started #12 and none completed - below the program."""
    dumps = {r: nccl_dump(12, 12, 11, history(12, "started")) for r in range(3)}
    (f,) = analyse(dumps)
    assert f.severity == "critical" and f.ranks == []
    assert "every rank started all_reduce #12" in f.issue and "network" in f.issue


def test_a_rank_whose_gpu_never_started_the_collective_is_named():
    """Rank 2 enqueued #12 but its stream never started it (busy with earlier work)."""
    dumps = {r: nccl_dump(12, 12, 11, history(12, "started")) for r in (0, 1)}
    dumps[2] = nccl_dump(12, 11, 11, history(12, "scheduled"))
    (f,) = analyse(dumps)
    assert f.ranks == [2] and "never started it" in f.issue


def test_a_rank_that_never_enqueued_the_collective_is_named_behind():
    dumps = {r: nccl_dump(12, 12, 11, history(12, "started")) for r in (0, 2)}
    dumps[1] = nccl_dump(11, 11, 11, [nccl_entry(s, "completed") for s in range(1, 12)])
    f = analyse(dumps)[0]
    assert f.ranks == [1] and "never entered all_reduce #12 on world that ranks 0,2 wait in" in f.issue


def test_a_rank_the_recorder_still_shows_in_an_earlier_collective_is_placed_by_its_stack():
    """gloo marks a collective completed on its own thread, after the caller returned: a rank
    stuck after #11 may still read 'in #11' - its main thread says where it really is."""
    dumps = {r: nccl_dump(12, 12, 11, history(12, "started")) for r in (0, 2)}
    dumps[1] = nccl_dump(11, 11, 10, history(11, "started"))
    snaps = snaps_of(dumps)
    snaps[1]["stack"] = ['File "train.py", line 40, in main\n    lock.acquire()']
    f = analyze_hang(snaps, {}, {}, 3, what="the job", timeout_s=30)[0]
    assert f.ranks == [1] and "never entered all_reduce #12" in f.issue
    assert "it waits in all_reduce #11" in f.issue and "main thread is at" in f.issue and "train.py" in f.issue


def test_without_start_events_the_stall_says_what_is_unknown():
    """NCCL without TORCH_NCCL_ENABLE_TIMING (started -1), or a dump that predates the field."""
    for started in (-1, None):
        dumps = {r: nccl_dump(12, started, 11, history(12, "scheduled")) for r in range(3)}
        (f,) = analyse(dumps)
        assert "does not complete" in f.issue and "TORCH_NCCL_ENABLE_TIMING=1" in f.fix


def test_different_sizes_at_the_same_sequence_number_is_a_desync_from_the_entries():
    """The collective no wrapper saw: rank 1 recorded another size at #7."""
    base = [nccl_entry(s, "completed") for s in range(1, 7)]
    dumps = {r: nccl_dump(9, 9, 8, base + [nccl_entry(7, "completed"), nccl_entry(8, "completed"), nccl_entry(9, "started")])
             for r in (0, 2)}
    dumps[1] = nccl_dump(9, 9, 8, base + [nccl_entry(7, "completed", sizes=((512,),)), nccl_entry(8, "completed"),
                                          nccl_entry(9, "started")])
    findings = analyse(dumps)
    desync = next(f for f in findings if "desync" in f.issue)
    assert desync.ranks == [1] and "#7" in desync.issue and "[[512]]" in desync.evidence


def test_entries_without_pg_status_still_give_positions():
    """An older dump with entries only: the states say what completed."""
    dump = {"version": "2.2", "entries": [nccl_entry(1, "completed"), nccl_entry(2, "started")]}
    (g,) = positions_from_dump(dump)["groups"]
    assert (g["enqueued"], g["completed"], g["pending"]["seq"], g["pending"]["state"]) == (2, 1, 2, "started")


def test_hang_report_reads_nccl_json_dumps_end_to_end(tmp_path):
    for r in range(3):
        started = 11 if r == 2 else 12
        (tmp_path / f"nccl_trace_rank_{r}").write_text(json.dumps(nccl_dump(12, started, 11, history(12, "started"))))
    out = CliRunner().invoke(app, ["hang-report", str(tmp_path), "--format", "json", "--exit-code"])
    assert out.exit_code == 3, out.output
    lead = json.loads(out.output)["probes"][0]["findings"][0]
    assert lead["ranks"] == [2] and "never started it" in lead["issue"]


def test_reader_degrades_with_a_stated_reason_never_an_exception():
    """No dump function in this torch; a dump function that raises; a recorder that is off."""
    none = EngineReader(dumpers=[])
    assert not none.available and none.read()["state"] == "unavailable" and "no JSON flight-recorder dump" in none.reason

    def broken(include_collectives, only_active):
        raise RuntimeError("not built with this backend")

    view = EngineReader(dumpers=[("nccl", broken)]).read()
    assert view["state"] == "unavailable" and "not built with this backend" in view["reason"]
    off = EngineReader(dumpers=[("fr", lambda a, b: json.dumps({"pg_status": {}}))]).read()
    assert off["state"] == "off" and "TORCH_FR_BUFFER_SIZE=2000" in off["reason"]


def test_reader_merges_two_backends_and_reads_string_numbers():
    """A group on gloo and NCCL at once (cpu:gloo,cuda:nccl); gloo's numbers come as strings."""
    gloo = {"pg_status": {"0": {"last_enqueued_collective": "5", "last_started_collective": "-1", "last_completed_collective": "5"}}}
    nccl = {"pg_status": {"0": {"last_enqueued_collective": 9, "last_started_collective": 9, "last_completed_collective": 8}},
            "entries": [nccl_entry(9, "started")]}
    reader = EngineReader(dumpers=[("fr", lambda a, b: json.dumps(gloo)), ("nccl", lambda a, b: json.dumps(nccl))])
    view = reader.read()
    by_backend = {g["backend"]: g for g in view["groups"]}
    assert by_backend["fr"]["pending"] is None and by_backend["fr"]["started"] is None
    pending = by_backend["nccl"]["pending"]
    assert pending["seq"] == 9 and pending["op"] == "all_reduce" and pending["shape"] == [1024]
    assert by_backend["nccl"]["group"].endswith("(nccl)") and reader.completed_total == 13


def test_malformed_dumps_are_value_errors():
    import pytest

    for bad in ([], {"entries": "x"}, "text"):
        with pytest.raises(ValueError):
            positions_from_dump(bad)  # type: ignore[arg-type]
    view = positions_from_dump({"entries": [5, "x", {"collective_seq_id": "junk", "profiling_name": 3}]})
    assert view["state"] in ("ok", "off")


def _entry(backend, pg_id, name, seq, state="completed"):
    e = nccl_entry(seq, state, pg=(name, "desc"))
    return {**e, "pg_id": pg_id, "profiling_name": f"{backend}:all_reduce"}


def test_nccl_and_gloo_recorders_number_their_groups_apart():
    """NCCL and gloo each count their own process groups: pg 1 of NCCL's recorder (a subgroup,
    named "5") is not pg 1 of the CPU recorder (the check's gloo side group, named "7"). Each
    row keeps its own group's label; a label learned from one recorder's entries never lands on
    the other's row."""
    nccl = {"pg_status": {"0": {"last_enqueued_collective": 3, "last_completed_collective": 3},
                          "1": {"last_enqueued_collective": 2, "last_completed_collective": 2}},
            "entries": [_entry("nccl", 1, "5", 1), _entry("nccl", 1, "5", 2), _entry("nccl", 0, "0", 3)]}
    gloo = {"pg_status": {"1": {"last_enqueued_collective": "4", "last_completed_collective": "4"}},
            "entries": [_entry("gloo", 1, "7", 4)]}
    reader = EngineReader(dumpers=[("nccl", lambda a, b: json.dumps(nccl)), ("fr", lambda a, b: json.dumps(gloo))])
    reader.read(tail=8)  # the entries teach each recorder's id -> name
    view = reader.read(tail=8)
    labels = {(g["backend"], g["pg"]): g["group"] for g in view["groups"]}
    assert labels[("nccl", "1")] == "group 5" and labels[("fr", "1")] == "group 7"
    assert labels[("nccl", "0")] == "group 0"
    assert reader.label_by_id("1", "nccl") == "group 5" and reader.label_by_id("1", "fr") == "group 7"


def test_one_group_on_both_backends_says_which_row_is_which():
    """A cpu:gloo,cuda:nccl group has one name on both recorders: two rows, told apart."""
    nccl = {"pg_status": {"0": {"last_enqueued_collective": 2, "last_completed_collective": 2}},
            "entries": [_entry("nccl", 0, "0", 2)]}
    gloo = {"pg_status": {"0": {"last_enqueued_collective": "1", "last_completed_collective": "1"}},
            "entries": [_entry("gloo", 0, "0", 1)]}
    reader = EngineReader(dumpers=[("nccl", lambda a, b: json.dumps(nccl)), ("fr", lambda a, b: json.dumps(gloo))])
    reader.read(tail=4)
    rows = sorted(g["group"] for g in reader.read(tail=4)["groups"])
    assert rows == ["group 0 (fr)", "group 0 (nccl)"]
