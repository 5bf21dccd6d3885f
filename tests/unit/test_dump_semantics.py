"""`distdiag hang-report DIR` blames from what the recorder's fields mean, one semantic per case.

SYNTHETIC dumps: NCCL-shaped, built here from the format torch 2.13 writes (FlightRecorderDetail.hpp:
pg_config keyed by group name with members as a string, pg_status keyed by the per-process pg_id,
entries with collective_seq_id / p2p_seq_id / state / retired, 'nccl:<op> a->b' for send/recv,
a coalesced batch's per-op entries beside a closing 'nccl:coalesced' entry). The real dumps torch
writes are read in tests/faults/test_dump_hangs.py and the real NCCL incidents in the acceptance
cases; these isolate one rule each, with the truth known.
"""

from __future__ import annotations

import json
import pickle
import time

import pytest
from typer.testing import CliRunner

from distdiag.cli import app

NOW = 1_758_610_505_000_000_000


class Job:
    """Per-rank dumps of one synthetic job: groups by name, entries in each rank's order."""

    def __init__(self, world: int):
        self.world = world
        self.groups: dict[str, tuple[str, list[int]]] = {"0": ("default_pg", list(range(world)))}
        self.entries: dict[int, list[dict]] = {r: [] for r in range(world)}
        self.status: dict[int, dict[str, dict[str, int]]] = {r: {} for r in range(world)}

    def group(self, name: str, desc: str, members: list[int]) -> str:
        self.groups[name] = (desc, members)
        return name

    def _pg_id(self, rank: int, name: str) -> int:
        # per process: the groups this rank belongs to, numbered in its own order (not comparable)
        mine = [n for n, (_, m) in self.groups.items() if rank in m]
        return mine.index(name) * 3 + rank % 2

    def op(self, rank: int, name: str, op: str, seq: int = 0, state: str = "scheduled", p2p_seq: int = 0,
           sizes: list[int] | None = None, age_s: float = 60.0) -> None:
        is_p2p = op.split(" ")[0] in ("send", "recv") or (op == "coalesced" and p2p_seq > 0)
        self.entries[rank].append({
            "record_id": len(self.entries[rank]), "pg_id": self._pg_id(rank, name),
            "process_group": [name, self.groups[name][0]], "collective_seq_id": 0 if is_p2p else seq,
            "p2p_seq_id": p2p_seq, "op_id": seq, "profiling_name": f"nccl:{op}",
            "time_created_ns": NOW - int(age_s * 1e9) + len(self.entries[rank]),
            "input_sizes": [sizes or [8, 8]], "input_dtypes": ["BFloat16"],
            "output_sizes": [sizes or [8, 8]], "output_dtypes": ["BFloat16"],
            "state": state, "retired": state == "completed", "timeout_ms": 600000, "is_p2p": is_p2p,
        })

    def position(self, rank: int, name: str, enqueued: int, completed: int) -> None:
        self.status[rank][str(self._pg_id(rank, name))] = {
            "last_enqueued_collective": enqueued, "last_started_collective": -1, "last_completed_collective": completed}

    def write(self, folder, only=None, name="nccl_trace_rank_{}") -> None:
        folder.mkdir(parents=True, exist_ok=True)
        config = {n: {"name": n, "desc": d, "ranks": str(m)} for n, (d, m) in self.groups.items()}
        for r in only if only is not None else range(self.world):
            dump = {"version": "2.9", "nccl_version": "2.27.3", "pg_config": config, "pg_status": self.status[r],
                    "entries": self.entries[r]}
            (folder / name.format(r)).write_text(json.dumps(dump))


def _report(path):
    out = CliRunner().invoke(app, ["hang-report", str(path), "--format", "json"])
    assert out.stdout.startswith("{"), out.output
    return json.loads(out.stdout)["probes"][0]["findings"], out.stderr


def _blamed(findings):
    return sorted({r for f in findings if f["severity"] in ("critical", "error") for r in f["ranks"]})


def _stalled_world(job: Job, waiting: list[int], behind: list[int], seq: int = 20) -> None:
    """`waiting` are inside world all_reduce #seq; `behind` completed #seq-1 and have nothing pending."""
    for r in waiting:
        job.op(r, "0", "all_reduce", seq)
        job.position(r, "0", seq, seq - 1)
    for r in behind:
        job.position(r, "0", seq - 1, seq - 1)


def test_a_matched_batched_transfer_in_flight_is_no_deadlock(tmp_path):
    """Ranks 0 and 1 are inside one batched send/recv (per-op entries and the closing coalesced
    entry all pending; p2p_seq_id 7 on one, 3 on the other), beside a second group of the same two
    members; rank 3 stopped before the world all_reduce rank 2 waits in. Only rank 3 is blamed."""
    job = Job(4)
    job.group("5", "PIPELINE_MODEL_PARALLEL_GROUP", [0, 1])
    job.group("6", "EMBEDDING_GROUP", [0, 1])
    for r, mine in ((0, 7), (1, 3)):
        job.op(r, "6", "all_reduce", 10, "completed")
        job.position(r, "6", 10, 10)
        way = "send 0->1" if r == 0 else "recv 1<-0"
        job.op(r, "5", way, p2p_seq=mine)
        job.op(r, "5", "coalesced", p2p_seq=mine)
        job.position(r, "0", 19, 19)
    _stalled_world(job, [2], [3])
    job.write(tmp_path)
    findings, _ = _report(tmp_path)
    assert _blamed(findings) == [3], findings
    assert not any(f.get("cause") == "deadlock" for f in findings), findings
    stall = next(f for f in findings if f.get("cause") == "collective_stall")
    assert "one transfer in flight" in stall["issue"] and stall["ranks"] == [], stall


def test_p2p_seq_ids_are_never_compared_across_ranks(tmp_path):
    """A middle pipeline stage counts send/recv differently: rank 1's p2p_seq_id is far ahead of
    rank 0's, yet the send and recv pair by sender and receiver. Rank 2 never posted its recv."""
    job = Job(3)
    job.group("7", "PIPELINE_MODEL_PARALLEL_GROUP", [0, 1, 2])
    job.op(0, "7", "send 0->1", p2p_seq=40, state="completed")
    job.op(1, "7", "recv 1<-0", p2p_seq=81, state="completed")
    job.op(1, "7", "send 1->2", p2p_seq=82)
    job.op(2, "7", "recv 2<-1", p2p_seq=40, state="completed")
    for r in range(3):
        job.position(r, "0", 3, 3)
    job.write(tmp_path)
    findings, _ = _report(tmp_path)
    assert _blamed(findings) == [2], findings
    lead = findings[0]
    assert "the recv matching rank 1's send to 2" in lead["issue"], lead


def test_an_uneven_all_to_all_with_one_rank_missing_blames_the_missing_rank(tmp_path):
    """Expert all_to_all sizes differ by design: the three ranks inside it are no desync."""
    job = Job(4)
    job.group("9", "EXPERT_MODEL_PARALLEL_GROUP", [0, 1, 2, 3])
    for r, rows in ((0, 1951), (1, 2037), (2, 2004)):
        job.op(r, "9", "all_to_all", 9, sizes=[rows, 5120])
        job.position(r, "9", 9, 8)
    job.position(3, "9", 8, 8)
    job.op(3, "9", "all_to_all", 8, "completed", sizes=[1990, 5120])
    job.write(tmp_path)
    findings, _ = _report(tmp_path)
    assert _blamed(findings) == [3], findings
    assert not any(f.get("cause") == "desync" for f in findings), findings


@pytest.mark.parametrize("op, desync", [("all_to_all", False), ("all_reduce", True)])
def test_sizes_differ_by_design_only_for_all_to_all_gather_scatter(tmp_path, op, desync):
    """Every member inside #9 with different sizes: a desync for all_reduce, a stall for all_to_all."""
    job = Job(2)
    for r, rows in ((0, 16), (1, 24)):
        job.op(r, "0", op, 9, sizes=[rows, 8])
        job.position(r, "0", 9, 8)
    job.write(tmp_path)
    findings, _ = _report(tmp_path)
    causes = {f.get("cause") for f in findings if f["severity"] == "critical"}
    assert causes == ({"desync"} if desync else {"collective_stall"}), findings


def test_stale_discovery_is_the_gpu_error_signature(tmp_path):
    """Rank 1's recorder froze at #40 on two groups while its peers completed up to #45 (they could
    not have without rank 1's kernels): rank 1 is blamed; rank 0 and rank 2, waiting, are not."""
    job = Job(3)
    job.group("3", "TENSOR_MODEL_PARALLEL_GROUP", [0, 1])
    job.group("4", "DATA_PARALLEL_GROUP", [1, 2])
    for name, peer in (("3", 0), ("4", 2)):
        for s in range(41, 47):
            job.op(1, name, "all_reduce", s)
            job.op(peer, name, "all_reduce", s, "completed" if s <= 45 else "scheduled")
        job.position(1, name, 46, 40)
        job.position(peer, name, 46, 45)
    job.write(tmp_path)
    findings, _ = _report(tmp_path)
    assert _blamed(findings) == [1], findings
    assert findings[0]["cause"] == "stale_completion", findings[0]


def test_coalesced_per_op_entries_take_the_closing_state(tmp_path):
    """A batched send/recv that completed (its per-op entries stay 'scheduled' for ever): not
    pending; rank 0 waits in the next all_reduce that rank 1 never entered."""
    job = Job(2)
    for r, way in ((0, "send 0->1"), (1, "recv 1<-0")):
        job.op(r, "0", way, p2p_seq=5)
        job.op(r, "0", "coalesced", p2p_seq=5, state="completed")
    job.op(0, "0", "all_reduce", 4)
    job.op(1, "0", "all_reduce", 3, "completed")
    job.write(tmp_path)
    findings, _ = _report(tmp_path)
    assert _blamed(findings) == [1], findings
    assert "never entered all_reduce #4 on world" in findings[0]["issue"], findings[0]


def test_a_completed_batch_left_in_an_only_active_dump_waits_on_nobody(tmp_path):
    """An only-active dump leaves out the batch's completed closing entry, but its per-op entries
    (no events: 'scheduled' for ever) stay listed: they are not pending sends that wait on rank 1."""
    job = Job(2)
    for r, ops in ((0, ("send 0->1", "recv 0<-1")), (1, ("recv 1<-0", "send 1->0"))):
        for way in ops:
            job.op(r, "0", way, p2p_seq=9)
    job.op(0, "0", "all_reduce", 4)
    job.write(tmp_path)
    findings, _ = _report(tmp_path)
    assert _blamed(findings) == [1], findings
    assert "never entered all_reduce #4 on world" in findings[0]["issue"], findings[0]


def test_an_op_seconds_old_at_dump_time_is_in_flight(tmp_path):
    """Ranks 0-1 wait in an all_reduce for 60 s that rank 2 never entered; rank 2 is inside an
    all_gather on another group created 0.5 s before the dump: it was still issuing work, so it is
    not named as stuck in it, and the waits it ends are a warning, not a verdict."""
    job = Job(4)
    job.group("8", "DATA_PARALLEL_GROUP", [2, 3])
    _stalled_world(job, [0, 1], [2, 3])
    job.op(2, "8", "all_gather", 30, age_s=0.5)
    job.position(2, "8", 30, 29)
    job.op(3, "8", "all_gather", 30, age_s=0.4)
    job.position(3, "8", 30, 29)
    job.write(tmp_path)
    findings, _ = _report(tmp_path)
    assert _blamed(findings) == [], findings
    assert {f.get("cause") for f in findings if f["severity"] == "warning"} == {"in_flight"}, findings


def test_a_rank_without_a_dump_is_the_end_of_the_chains(tmp_path):
    job = Job(3)
    _stalled_world(job, [0, 1], [2])
    job.write(tmp_path, only=[0, 1])
    findings, _ = _report(tmp_path)
    assert _blamed(findings) == [2] and findings[0]["cause"] == "no_dump", findings


# -- folders as users keep them ------------------------------------------------------------------


def _small_job() -> Job:
    job = Job(2)
    job.op(0, "0", "all_reduce", 4)
    job.op(1, "0", "all_reduce", 3, "completed")
    return job


def test_other_files_in_the_folder_are_skipped_with_one_line(tmp_path):
    _small_job().write(tmp_path)
    (tmp_path / "fault_injection.log").write_text("Fault ranks: [1]\n")
    (tmp_path / "README.md").write_text("# dumps\n")
    findings, err = _report(tmp_path)
    assert _blamed(findings) == [1], findings
    assert err.count("\n") == 1 and "skipped 2 file(s)" in err and "fault_injection.log" in err, err


@pytest.mark.parametrize("layout", ["host-prefixed", "folder-per-rank", "folder-per-rank-bare"])
def test_host_prefixed_names_and_one_folder_per_rank(tmp_path, layout):
    job = _small_job()
    for r in range(2):
        if layout == "host-prefixed":
            job.write(tmp_path, only=[r], name=f"node{7 + r}_nccl_trace_rank_{{}}")
        elif layout == "folder-per-rank":
            job.write(tmp_path / f"rank_{r}", only=[r])
        else:  # the rank only in the folder's name
            job.write(tmp_path / f"rank{r}", only=[r], name="trace.json")
    findings, err = _report(tmp_path)
    assert _blamed(findings) == [1] and not err, (findings, err)


def _memo_bomb(levels: int = 6, width: int = 60) -> bytes:
    """{'entries': L6}: L1 = [], each L(i) a list of `width` references (BINGET) to L(i-1)."""
    out = b"\x80\x02}q\x00X\x07\x00\x00\x00entriesq\x01]q\x020"
    for i in range(3, levels + 2):
        out += b"(" + (b"h" + bytes([i - 1])) * width + b"lq" + bytes([i]) + b"0"
    return out + b"h" + bytes([levels + 1]) + b"s."


def test_a_memo_bomb_is_refused_quickly(tmp_path):
    """A few hundred bytes of pickle that reuse the memo to make a tree of 60**5 references:
    refused in one line, long before a walk over it would end."""
    data = _memo_bomb()
    assert len(data) < 800 and len(pickle.loads(data)["entries"]) == 60
    (tmp_path / "nccl_trace_rank_0").write_bytes(data)
    t0 = time.monotonic()
    out = CliRunner().invoke(app, ["hang-report", str(tmp_path)])
    assert time.monotonic() - t0 < 10 and out.exit_code == 2, out.output
    assert out.output.count("\n") == 1 and "values" in out.output, out.output  # the reader's bound on values


def test_a_huge_memo_index_is_no_allocation(tmp_path):
    """LONG_BINPUT 0x7fffffff would make C's unpickler size its memo for 2**31 slots."""
    (tmp_path / "nccl_trace_rank_0").write_bytes(b"\x80\x02}r\xff\xff\xff\x7f.")
    out = CliRunner().invoke(app, ["hang-report", str(tmp_path)])
    assert out.exit_code == 2 and "no 'entries'" in out.output, out.output


def _gloo_dump(seqs_done: int, pending: int | None) -> dict:
    """gloo's dump as torch 2.13 writes it: every entry 'scheduled', completion only as `retired`,
    no membership in pg_config (its placeholder row), pg_status keyed by its own pg_id."""
    entries = [{"record_id": s, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": s,
                "p2p_seq_id": 0, "op_id": s, "profiling_name": "gloo:all_reduce", "time_created_ns": NOW + s,
                "input_sizes": [[4]], "input_dtypes": ["Float"], "output_sizes": [[4]], "output_dtypes": ["Float"],
                "state": "scheduled", "retired": s <= seqs_done, "timeout_ms": 600000, "is_p2p": False}
               for s in range(1, (pending or seqs_done) + 1)]
    last = pending or seqs_done
    return {"version": "2.10", "comm_lib_version": "", "pg_config": {"": {"name": "", "desc": "", "ranks": "[]"}},
            "pg_status": {"0": {"last_enqueued_collective": last, "last_started_collective": -1,
                                "last_completed_collective": seqs_done}}, "entries": entries}


def test_nccl_and_gloo_recorders_of_one_rank_are_kept_apart(tmp_path):
    """Each rank left an NCCL dump (nothing pending) and a gloo dump (the default group's gloo
    side: rank 0 inside all_reduce #3, rank 1 never entered it). Both recorders number group '0'
    from 1: read together they would mix; kept apart, rank 1 is named by the gloo recorder."""
    job = Job(2)
    for r in range(2):
        job.op(r, "0", "all_reduce", 40, "completed")
        job.position(r, "0", 40, 40)
    job.write(tmp_path)
    (tmp_path / "gloo_trace_rank_0.json").write_text(json.dumps(_gloo_dump(2, 3)))
    (tmp_path / "gloo_trace_rank_1.json").write_text(json.dumps(_gloo_dump(2, None)))
    findings, err = _report(tmp_path)
    assert _blamed(findings) == [1] and not err, (findings, err)
    assert findings[0]["issue"].startswith("gloo recorder: rank 1 never entered all_reduce #3 on world"), findings[0]
