"""The hang watchdog on real gloo ranks: each injected bug is named; each healthy twin is quiet.

Ranks run tests/faults/watchdog_workers.py:train through the forkserver harness (store in
the parent, like torchrun's agent). Timeouts are 3 s; elapsed-time bounds are wide on purpose
(the machine is shared).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from distdiag.report.model import read_report
from tests.harness import RunResult, run_ranks

ENTRY = "tests.faults.watchdog_workers:train"
WORKERS = "watchdog_workers.py"
HARD_TIMEOUT = 45.0


def _run(tmp_path: Path, world: int, *words: str) -> RunResult:
    return run_ranks(world, list(words), tmp_path, entry=ENTRY, timeout=HARD_TIMEOUT)


def _report(result: RunResult):
    report = read_report(result.workdir / "hang-report" / "hang-report.json")
    probe = report.probe("watchdog")
    assert probe is not None
    crit = [f for f in probe.findings if f.severity == "critical"]
    assert crit, probe.findings
    return report, probe, crit


def _line(marker: str) -> str:
    """`watchdog_workers.py:LINE` of the line carrying `marker` (robust to edits)."""
    text = (Path(__file__).parent / WORKERS).read_text().splitlines()
    number = next(i for i, line in enumerate(text, 1) if marker in line)
    return f"{WORKERS}:{number}"


def _assert_aborted(result: RunResult, killed: tuple[int, ...] = ()) -> None:
    assert not result.timed_out, result.stderr[-3000:]
    for o in result.outcomes:
        assert o.exitcode == (-9 if o.rank in killed else 3), (o.rank, o.exitcode, o.stderr[-2000:])
    assert result.elapsed < 30, result.elapsed


@pytest.mark.parametrize(
    "fault,word,site",
    [("skip", "skipped", "SITE:B"), ("extra", "extra", "FAULT:extra")],
    ids=["skipped-all-reduce", "extra-same-shape-all-reduce"],
)
@pytest.mark.timeout(60)
def test_skipped_or_extra_all_reduce_is_a_desync_naming_rank_step_and_both_sites(tmp_path, fault, word, site):
    """Rank 1 skips one all_reduce in step 2 (gloo pairs its next one silently), or issues one
    extra same-shape all_reduce (DETAIL and the recorder miss it; we do not)."""
    # wrap=1: found while the job still runs, at the next step mark, from the wrappers'
    # fingerprints; the recorder has no live comparison (without wrappers it is found once it
    # hangs: test_skipped_all_reduce_without_wrappers_is_located_once_it_hangs). steps=30: the
    # job runs ~5.6 s past the fault before its final hang, so a watchdog thread starved by a
    # loaded CPU still compares marks first (with steps=14 a full-suite run once saw the hang
    # declared first: outcome 'hang', issue 24's load runs)
    result = _run(tmp_path, 3, f"fault={fault}", "rank=1", "step=2", "steps=30", "wrap=1")
    _assert_aborted(result)
    report, probe, crit = _report(result)
    f = crit[0]
    # What a failure must show (a full-suite run once failed here and kept nothing): the
    # verdict, which ranks' snapshots the writer had, and the ranks' own lines.
    why = (report.outcome, f.ranks, f.issue, report.written_by, probe.details.get("gathered"), result.stderr[-3000:])
    assert report.outcome == "desync" and f.ranks == [1], why
    assert word in f.issue and "step 2" in f.issue, why
    assert _line(site) in f.issue and _line("SITE:C") in f.issue, why


@pytest.mark.timeout(60)
def test_all_gather_where_others_all_reduce_names_rank_and_both_ops(tmp_path):
    """Rank 1 calls all_gather where ranks 0 and 2 call all_reduce: gloo hangs; a desync."""
    result = _run(tmp_path, 3, "fault=op_mismatch", "rank=1", "step=2")
    _assert_aborted(result)
    _, _, crit = _report(result)
    f = next(f for f in crit if "desync" in f.issue)
    assert f.ranks == [1]
    text = f.issue + f.evidence
    assert "all_gather" in text and "all_reduce" in text
    assert _line("FAULT:op_mismatch") in f.evidence and _line("SITE:B") in f.evidence


@pytest.mark.timeout(60)
def test_a_barrier_inside_a_library_on_one_rank_names_the_jobs_line_once(tmp_path):
    """Rank 1 calls a library (installed under a site-packages folder) that issues a barrier, where
    its peers issue the next all_reduce: one critical finding (not a second one telling the same
    at the same sequence number), the barrier with no tensor shape, and the job's line that
    called the library before the library's own."""
    lib = tmp_path / "lib" / "site-packages"
    lib.mkdir(parents=True)
    (lib / "fakesync.py").write_text("import torch.distributed as dist\n\n\ndef sync():\n    dist.barrier()\n")
    result = _run(tmp_path, 3, "fault=lib_barrier", "rank=1", "step=2", f"libdir={lib}")
    _assert_aborted(result)
    _, _, crit = _report(result)
    assert len(crit) == 1 and crit[0].ranks == [1] and crit[0].cause == "desync", [f.issue for f in crit]
    issue = crit[0].issue
    assert "barrier at" in issue and "(?" not in issue, issue
    assert f"{_line('FAULT:lib_barrier')} in train" in issue and f"(through {lib}/fakesync.py:5 in sync)" in issue, issue


@pytest.mark.timeout(60)
def test_rank_blocked_outside_any_collective_is_named_with_its_line(tmp_path):
    """Rank 1 blocks forever outside a collective while rank 0 waits in all_reduce."""
    result = _run(tmp_path, 2, "fault=block", "rank=1", "step=2")
    _assert_aborted(result)
    report, probe, crit = _report(result)
    assert crit[0].ranks == [1] and "never entered all_reduce" in crit[0].issue
    assert _line("FAULT:block") in crit[0].issue
    rows = {r["rank"]: r for r in probe.details["table:ranks at the end"]}
    assert rows[0]["state"] == "collective" and _line("SITE:A") in rows[0]["where"]
    assert "watchdog" in result.stderr and report.written_by in (0, 1)


@pytest.mark.timeout(60)
def test_rank_sleeping_in_data_loading_shows_the_sleeping_frame(tmp_path):
    result = _run(tmp_path, 2, "fault=sleep_data", "rank=1", "step=2")
    _assert_aborted(result)
    _, probe, crit = _report(result)
    assert crit[0].ranks == [1] and "load_batch" in crit[0].issue and _line("FAULT:sleep_data") in crit[0].issue
    assert any("load_batch" in line for line in probe.details["stacks"]["1"])


@pytest.mark.timeout(60)
def test_rank0_stuck_another_rank_writes_the_report(tmp_path):
    result = _run(tmp_path, 2, "fault=block", "rank=0", "step=2")
    _assert_aborted(result)
    _, _, crit = _report(result)
    assert crit[0].ranks == [0] and _line("FAULT:block") in crit[0].issue


@pytest.mark.timeout(60)
def test_sigkilled_rank_is_named_dead(tmp_path):
    result = _run(tmp_path, 2, "fault=kill", "rank=1", "step=2")
    _assert_aborted(result, killed=(1,))
    report, _, crit = _report(result)
    assert report.outcome == "lost_rank" and crit[0].ranks == [1] and "gone" in crit[0].issue


@pytest.mark.timeout(60)
def test_sigstopped_rank_is_named_and_ended_by_pid(tmp_path):
    """A stopped rank ignores SIGTERM: the writer ends it (same host) and every process is gone."""
    result = _run(tmp_path, 2, "fault=stop", "rank=1", "step=2")
    _assert_aborted(result, killed=(1,))
    _, _, crit = _report(result)
    assert crit[0].ranks == [1] and "stopped" in crit[0].issue


@pytest.mark.timeout(60)
def test_action_raise_interrupts_python_code_and_aborts_the_blocked_rank(tmp_path):
    result = _run(tmp_path, 2, "fault=spin", "rank=1", "step=2", "action=raise")
    assert not result.timed_out
    assert result.codes == [3, 1], result.stderr[-3000:]
    assert "HangDetected" in result.outcomes[1].stderr or "RaisedHang" in result.outcomes[1].stderr
    assert "cannot be interrupted" in result.outcomes[0].stderr
    _, _, crit = _report(result)
    assert crit[0].ranks == [1]


@pytest.mark.timeout(60)
def test_action_report_writes_and_lets_the_job_finish(tmp_path):
    result = _run(tmp_path, 2, "fault=stall", "rank=1", "step=2", "action=report")
    assert result.codes == [0, 0], result.stderr[-3000:]
    _, _, crit = _report(result)
    assert crit[0].ranks == [1]


@pytest.mark.parametrize(
    "fault,extra",
    [
        ("slow_step", []), ("checkpoint", []), ("eval", ["timeout=2", "pg_timeout=1.5"]), ("branch", []),
        ("slow_step", ["action=raise"]), ("slow_step", ["action=report"]), ("val_even", []),
    ],
    ids=["slow-step", "checkpoint-phase", "long-eval", "rank-dependent-call-site", "slow-step-raise", "slow-step-report",
         "even-validation-pass"],
)
@pytest.mark.timeout(60)
def test_healthy_twins_write_no_report(tmp_path, fault, extra):
    """Slower step within the timeout, a long checkpoint declared as a phase, a long eval, and
    rank 1 issuing the same all_reduce from a different line every step (the desync detector's
    twin: call sites stay out of the digest): quiet, with every action (abort, raise, report)."""
    result = _run(tmp_path, 2, f"fault={fault}", "rank=1", "step=2", "steps=5", *extra)
    assert result.codes == [0, 0], result.stderr[-3000:]
    assert not (tmp_path / "hang-report").exists()
    if fault == "eval":
        assert "shorter than the watchdog's" in result.stderr  # pg timeout 1.5 s < watchdog 2 s


@pytest.mark.parametrize("fault", ["val_even", "val_even_list", "lib_barrier_all"],
                         ids=["even-pass-large-metric", "even-list-pass-large-metric", "library-barrier-on-every-rank"])
@pytest.mark.timeout(60)
def test_twins_of_the_abort_and_library_faults_at_three_ranks_write_no_report(tmp_path, fault):
    """The twins of the short pass that gloo aborts its own rank for (DataLoader and plain list,
    256-float metric) and of the library barrier on one rank, at the faults' world size: every
    rank runs the same pass, or calls the library: quiet."""
    lib = tmp_path / "lib" / "site-packages"
    lib.mkdir(parents=True)
    (lib / "fakesync.py").write_text("import torch.distributed as dist\n\n\ndef sync():\n    dist.barrier()\n")
    result = _run(tmp_path, 3, f"fault={fault}", "rank=1", "step=2", "steps=5", "metric=256", f"libdir={lib}")
    assert result.codes == [0, 0, 0], result.stderr[-3000:]
    assert not (tmp_path / "hang-report").exists()


@pytest.mark.timeout(60)
def test_desync_twin_at_the_fault_runs_world_and_length(tmp_path):
    """The skip/extra desync runs (3 ranks, 14 steps) with rank 1 calling from another line
    instead of skipping or adding: no report."""
    result = _run(tmp_path, 3, "fault=branch", "rank=1", "step=2", "steps=14", "wrap=1")  # as the faults run
    assert result.codes == [0, 0, 0], result.stderr[-3000:]
    assert not (tmp_path / "hang-report").exists()


@pytest.mark.timeout(60)
def test_user_signal_handlers_are_kept_and_torch_restored(tmp_path):
    result = run_ranks(2, [], tmp_path, entry="tests.faults.watchdog_workers:handlers_kept", timeout=HARD_TIMEOUT)
    assert result.codes == [0, 0], result.stderr[-3000:]


@pytest.mark.timeout(90)
def test_fsdp2_and_dtensor_collectives_are_fingerprinted_without_false_desync(tmp_path):
    result = run_ranks(2, [], tmp_path, entry="tests.faults.watchdog_workers:fsdp_dtensor", timeout=75)
    assert result.codes == [0, 0], result.stderr[-3000:]
    assert "funcol:" in result.stderr and "reduce_scatter" in result.stderr
    assert not (tmp_path / "hang-report").exists()


@pytest.mark.timeout(120)
def test_healthy_ddp_without_step_marks_is_not_a_hang(tmp_path):
    """DDP all-reduces in C++ where the watchdog cannot see them; with no step marks a long
    stretch without tracked collectives is not a hang (it was killed before this fix)."""
    result = run_ranks(2, ["1.5", "80"], tmp_path, entry="tests.faults.ddp_worker:main", timeout=90)
    assert result.codes == [0, 0], result.stderr[-2000:]
    assert not (tmp_path / "hang-report" / "hang-report.json").exists()


@pytest.mark.parametrize("world,culprit", [(2, 0), (3, 1), (4, 3)], ids=["2-ranks", "3-ranks-middle", "4-ranks-last"])
@pytest.mark.timeout(60)
def test_extra_collective_that_gloo_aborts_a_peer_for_blames_the_rank_that_issued_it(tmp_path, world, culprit):
    """One rank issues an extra, larger all_reduce: gloo pairs it with its peers' next one and
    aborts a receiver (SIGABRT, "Received data size doesn't match"). The dead rank is the
    messenger: the lead names the rank whose steps changed course, with both lines."""
    result = _run(tmp_path, world, "fault=extra_big", f"rank={culprit}", "step=3", "steps=8")
    assert not result.timed_out, result.stderr[-3000:]
    aborted = [o.rank for o in result.outcomes if o.exitcode == -6]
    assert aborted and culprit not in aborted, [(o.rank, o.exitcode) for o in result.outcomes]
    _, probe, crit = _report(result)
    assert crit[0].ranks == [culprit] and crit[0].cause == "desync", crit[0].issue
    assert _line("FAULT:extra_big").split(":")[1] in crit[0].issue and _line("SITE:C").split(":")[1] in crit[0].issue
    dead = [f for f in probe.findings if f.cause == "aborted_in_collective"]
    assert dead and set(dead[0].ranks) <= set(aborted) and "SIGABRT" in dead[0].issue


@pytest.mark.parametrize("world,culprit", [(2, 1), (3, 1), (4, 0)], ids=["2-ranks", "3-ranks-middle", "4-ranks-first"])
@pytest.mark.timeout(60)
def test_a_short_validation_pass_that_gloo_aborts_a_peer_for_is_uneven_data(tmp_path, world, culprit):
    """A rank whose validation DataLoader ends first goes on to the pass's end collective (an int64
    count) while its peers issue the next batch's metric all_reduce (float32): gloo pairs them by
    order and aborts a receiver (SIGABRT). The abort ended everyone's wait; the loaders say who
    ran out: the lead is uneven data on the short rank, the dead rank a consequence."""
    result = _run(tmp_path, world, "fault=val_short", f"rank={culprit}", "step=2", "steps=5")
    assert not result.timed_out, result.stderr[-3000:]
    aborted = [o.rank for o in result.outcomes if o.exitcode == -6]
    assert aborted and culprit not in aborted, [(o.rank, o.exitcode) for o in result.outcomes]
    _, probe, crit = _report(result)
    assert crit[0].ranks == [culprit] and crit[0].cause == "uneven_data", crit[0].issue
    assert "ended after 3 batch(es)" in crit[0].issue and "SIGABRT" in crit[0].evidence, crit[0]
    assert all(f.severity != "critical" for f in probe.findings if set(f.ranks) & set(aborted)), probe.findings


@pytest.mark.parametrize("world,culprit", [(2, 1), (3, 1), (4, 0)], ids=["2-ranks", "3-ranks-middle", "4-ranks-first"])
@pytest.mark.timeout(60)
def test_a_short_validation_pass_whose_own_rank_gloo_aborts_is_uneven_data(tmp_path, world, culprit):
    """The per-batch metric is larger than the pass's end count: gloo aborts the short rank itself,
    in the count's all_reduce. Its loaders are gone with it, but the copy its DataLoader tap wrote
    when the pass ended (beside its death note) says the pass ended first: uneven data on it."""
    result = _run(tmp_path, world, "fault=val_short", f"rank={culprit}", "step=2", "steps=5", "metric=256")
    assert not result.timed_out, result.stderr[-3000:]
    aborted = [o.rank for o in result.outcomes if o.exitcode == -6]
    assert aborted == [culprit], [(o.rank, o.exitcode) for o in result.outcomes]
    _, probe, crit = _report(result)
    assert crit[0].ranks == [culprit] and crit[0].cause == "uneven_data", crit[0].issue
    assert "ended after 3 batch(es)" in crit[0].issue and "SIGABRT" in crit[0].issue, crit[0]
    assert _line("SITE:val_count") in crit[0].issue, crit[0].issue
    assert all(f.severity != "critical" for f in probe.findings if culprit not in f.ranks), probe.findings
    # the title names the outcome (a lost rank) and, as it differs, the lead's cause
    printed = result.stdout + result.stderr
    assert f"lost_rank report, {world} rank(s) on 1 host(s)" in printed and f"; lead: uneven_data on rank {culprit}" in printed


@pytest.mark.timeout(60)
def test_a_short_pass_over_a_plain_list_whose_rank_gloo_aborts_blames_neither_side_alone(tmp_path):
    """The same without a DataLoader (a plain list): nothing says whose data ended. Both sides were
    at lines new to them (the survivor's per-batch metric, the dead rank's count): both named,
    the mechanism not identified; never the survivor alone for its 'departure'."""
    result = _run(tmp_path, 2, "fault=val_short_list", "rank=1", "step=2", "steps=5", "metric=256")
    assert not result.timed_out, result.stderr[-3000:]
    assert [o.rank for o in result.outcomes if o.exitcode == -6] == [1], [(o.rank, o.exitcode) for o in result.outcomes]
    _, _, crit = _report(result)
    assert crit[0].ranks == [0, 1] and "not identified" in crit[0].issue, crit[0].issue
    assert _line("SITE:val_count") in crit[0].issue and _line("SITE:val_metric") in crit[0].issue


@pytest.mark.timeout(60)
def test_segfaulted_rank_is_named_with_its_signal_and_frame(tmp_path):
    result = _run(tmp_path, 2, "fault=segv", "rank=1", "step=2")
    assert not result.timed_out, result.stderr[-3000:]
    _, _, crit = _report(result)
    assert crit[0].ranks == [1] and "SIGSEGV" in crit[0].issue and "string_at" in crit[0].issue


@pytest.mark.parametrize("kind,fault,world,culprit", [
    ("pipe", "skip_grad", 3, 2), ("ring", "skip_ring", 3, 2), ("ring", "skip_ring", 4, 1),
], ids=["pipeline-last-stage-skips-a-grad", "ring-last-rank-skips-its-send", "ring-4-middle-rank-skips-its-send"])
@pytest.mark.timeout(60)
def test_a_skipped_send_names_the_rank_that_skipped_it_not_a_deadlock(tmp_path, kind, fault, world, culprit):
    """send/recv pair by sender and receiver in order: a receive waits for ever when its peer
    issued one send fewer. The ranks waiting on each other form a cycle, but no ordering of
    groups is at fault: the per-peer counts (and, where every pair is short, the rank whose
    own ops stopped repeating) name the rank that skipped the send."""
    result = run_ranks(world, [f"kind={kind}", f"fault={fault}", f"rank={culprit}", "step=3", "steps=8", "timeout=3",
                               "step_s=0.05"], tmp_path, entry="tests.faults.watchdog_workers:p2p", timeout=HARD_TIMEOUT)
    assert not result.timed_out, result.stderr[-3000:]
    _, _, crit = _report(result)
    assert crit[0].ranks == [culprit] and crit[0].cause == "desync" and "skipped a send" in crit[0].issue, crit[0].issue


@pytest.mark.parametrize("kind", ["pipe", "ring"])
@pytest.mark.timeout(60)
def test_send_recv_twins_write_no_report(tmp_path, kind):
    result = run_ranks(3, [f"kind={kind}", "fault=none", "steps=8", "timeout=3", "step_s=0.05"], tmp_path,
                       entry="tests.faults.watchdog_workers:p2p", timeout=HARD_TIMEOUT)
    assert not result.timed_out and all(o.exitcode == 0 for o in result.outcomes), result.stderr[-3000:]
    assert not (tmp_path / "hang-report").exists()
