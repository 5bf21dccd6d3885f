"""Across groups, the rank where the chain of waits ends is blamed; the ranks it stranded are not.

Issue 22: in a 2x2 mesh a rank stalled before its TP all-reduce strands its TP partner, which
strands its DP partner; in a pipeline a stalled last stage strands the first stage in its
`recv`. The wait-for graph (distdiag.hang.waitfor) names only the end of each chain, lists the
stranded ranks with their chains, and names a cycle between groups as a deadlock. Each fault
runs for real on gloo under the in-code watchdog (3 s) - a rank stalled, raising, killed, a
deadlock; each has a healthy twin that must write no report. One case runs the zero-code wrapper as the user did (torchrun -m distdiag.watch).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from distdiag.report.model import read_report
from tests.harness import run_ranks

ENTRY = "tests.faults.mesh_workers:train"
SCRIPT = Path(__file__).parent / "mesh_workers.py"
HARD = 60.0


def _line(marker: str) -> str:
    text = SCRIPT.read_text().splitlines()
    return f"{SCRIPT.name}:{next(i for i, line in enumerate(text, 1) if marker in line)}"


def _findings(workdir: Path):
    probe = read_report(workdir / "hang-report" / "hang-report.json").probe("watchdog")
    crit = [f for f in probe.findings if f.severity == "critical"]
    assert crit, probe.findings
    return crit[0], probe.findings


def _blamed(findings) -> set[int]:
    return {r for f in findings if f.severity in ("critical", "error", "warning") for r in f.ranks}


def _stranded(findings) -> str:
    info = [f for f in findings if "stranded, not at fault" in f.issue]
    assert len(info) == 1, [f.issue for f in findings]
    return info[0].evidence


def _run(tmp_path: Path, world: int, *words: str):
    result = run_ranks(world, list(words), tmp_path, entry=ENTRY, timeout=HARD)
    assert not result.timed_out and result.codes.count(3) >= world - 1, result.stderr[-3000:]
    return _findings(tmp_path)


@pytest.mark.timeout(90)
def test_tp_dp_mesh_rank_stalled_before_tp_all_reduce_is_the_only_culprit(tmp_path):
    """2x2 mesh (dp, tp): rank 3 stalls in its data loader before the TP all-reduce; rank 2 waits
    for it in TP, rank 0 for rank 2 in DP, rank 1 for rank 3 in DP."""
    lead, findings = _run(tmp_path, 4, "kind=tpdp", "fault=stall", "rank=3")
    assert lead.ranks == [3] and _line("FAULT:stall-loader") in lead.issue, lead.issue
    assert _blamed(findings) == {3}, [(f.ranks, f.issue) for f in findings]
    chains = _stranded(findings)
    assert "rank 0 waits for 2 in all_reduce #3 on ranks[0,2] (float32[8x8]); rank 2 waits for 3 in all_reduce #3 on ranks[2,3] (float32[4x8])" in chains
    assert "rank 1 waits for 3 in all_reduce #3 on ranks[1,3]" in chains and "load_next_microbatch" in chains


@pytest.mark.timeout(90)
def test_pipeline_last_stage_stalled_in_its_loss_is_the_only_culprit(tmp_path):
    """pp=2 x dp=2: rank 1 (a last stage) stalls in its loss; rank 0 waits in its recv from rank 1,
    rank 2 for rank 0 in DP, rank 3 for rank 1 in DP."""
    lead, findings = _run(tmp_path, 4, "kind=pp", "fault=stall", "rank=1")
    assert lead.ranks == [1] and _line("FAULT:stall-loss") in lead.issue, lead.issue
    assert _blamed(findings) == {1}, [(f.ranks, f.issue) for f in findings]
    chains = _stranded(findings)
    assert "rank 0 waits for 1 in recv from rank 1 (float32[4x8])" in chains
    assert "rank 2 waits for 0 in all_reduce #3 on ranks[0,2]" in chains


@pytest.mark.timeout(90)
def test_groups_issued_in_opposite_order_are_a_deadlock_with_its_cycle(tmp_path):
    """Groups [0,1], [1,2], [0,2]; from step 2 rank 0 issues its two in the opposite order:
    0 waits for 2, 2 for 1, 1 for 0."""
    lead, findings = _run(tmp_path, 3, "kind=cycle", "fault=deadlock", "rank=0")
    assert lead.issue.startswith("deadlock between groups") and lead.ranks == [0, 1, 2], lead.issue
    for edge in ("rank 0 waits for 2 in all_reduce #3 on ranks[0,2]", "rank 2 waits for 1 in all_reduce #3 on ranks[1,2]",
                 "rank 1 waits for 0 in all_reduce #3 on ranks[0,1]"):
        assert edge in lead.issue


@pytest.mark.timeout(90)
def test_a_rank_raising_between_its_groups_leads_and_the_stranded_are_not_blamed(tmp_path):
    """Rank 3 raises in its loss between its TP and DP all-reduces: rank 1 waits for it in DP,
    rank 2 in the next TP all-reduce, rank 0 for rank 1 in TP."""
    lead, findings = _run(tmp_path, 4, "kind=tpdp", "fault=raise", "rank=3")
    assert lead.ranks == [3] and "loss is nan at step 2" in lead.issue, lead.issue
    assert "on ranks[0,1]" not in lead.issue  # rank 3 is no member of the group rank 0 waits in
    assert _blamed(findings) == {3}, [(f.ranks, f.issue) for f in findings]
    assert "rank 0 waits for 1 in all_reduce #4 on ranks[0,1]" in _stranded(findings)


@pytest.mark.timeout(90)
def test_tp_dp_mesh_rank_killed_in_one_group_is_named_lost_and_nobody_else_blamed(tmp_path):
    """2x2 mesh: rank 3 is SIGKILLed in its data loader. Its TP partner (2) and DP partner (1)
    learn it as a closed connection, rank 0 is stranded in its DP all-reduce with rank 2: only
    rank 3 is named, as gone; the report still says where rank 0 waits and on which line.
    (Healthy twin: test_healthy_multigroup_twins_write_no_report's tpdp case.)"""
    result = run_ranks(4, ["kind=tpdp", "fault=kill", "rank=3"], tmp_path, entry=ENTRY, timeout=HARD)
    assert not result.timed_out and result.codes == [3, 3, 3, -9], result.stderr[-3000:]
    lead, findings = _findings(tmp_path)
    assert lead.ranks == [3] and "lost" in lead.issue and "gone" in lead.issue, lead.issue
    assert _blamed(findings) == {3}, [(f.ranks, f.issue) for f in findings]
    rows = read_report(tmp_path / "hang-report" / "hang-report.json").probe("watchdog").details["table:ranks at the end"]
    waiting = {r["rank"]: r["where"] for r in rows if r["state"] == "collective"}
    # rank 2 is alive until the report is out, so rank 0 still waits in the DP all-reduce
    assert "on ranks[0,2]" in waiting[0] and _line("the DP all-reduce of the grads") in waiting[0], waiting


@pytest.mark.parametrize("world,kind", [(4, "tpdp"), (4, "pp"), (3, "cycle")])
@pytest.mark.timeout(90)
def test_healthy_multigroup_twins_write_no_report(tmp_path, world, kind):
    """The same jobs without a fault: no report, every rank exits 0."""
    result = run_ranks(world, [f"kind={kind}", "steps=6"], tmp_path, entry=ENTRY, timeout=HARD)
    assert result.codes == [0] * world, result.stderr[-3000:]
    assert not (tmp_path / "hang-report").exists()


@pytest.mark.torchrun
@pytest.mark.timeout(150)
def test_zero_code_mesh_stall_names_only_the_stalled_rank(cli_env, tmp_path):
    """The user's run: an unchanged 2x2 mesh script under torchrun -m distdiag.watch --timeout-s 3."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone",
           "-m", "distdiag.watch", "--timeout-s", "3", "--", str(SCRIPT), "kind=tpdp", "fault=stall", "rank=3"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stderr[-3000:]
    lead, findings = _findings(tmp_path)
    assert lead.ranks == [3] and "load_next_microbatch" in lead.issue + lead.evidence, lead.issue
    assert _blamed(findings) == {3}, [(f.ranks, f.issue) for f in findings]
    assert "rank 2 waits for 3 in all_reduce" in _stranded(findings)


# -- two ranks, uneven data: the rank that departs from its own history ----------------------------


@pytest.mark.parametrize("fault,word", [("op_mismatch", "all_gather"), ("skip", "skipped")])
@pytest.mark.timeout(90)
def test_two_rank_desync_names_the_rank_that_departs_from_its_history(tmp_path, fault, word):
    """Two ranks, no majority: rank 1 issues all_gather where its steps issued all_reduce, or
    skips one; its own earlier steps say it is the one that changed course."""
    # wrap=1: the tie is broken by each rank's own step history, which needs every step's call
    # sites. Without wrappers they come from the recorder's stack dump, ready only once its
    # one-time warm-up is done (seconds after the first collective on a busy host: maybe after
    # this early fault); and the skip hangs only at the end of the loop, where rank 1 is named
    # as the rank that ran short, not by the skipped line (docs/watchdog.md, "Wrappers are off
    # by default")
    result = run_ranks(2, [f"fault={fault}", "rank=1", "step=3", "steps=8", "timeout=3", "wrap=1"], tmp_path,
                       entry="tests.faults.watchdog_workers:train", timeout=HARD)
    assert not result.timed_out and result.codes == [3, 3], result.stderr[-3000:]
    lead, findings = _findings(tmp_path)
    assert lead.ranks == [1] and "desync" in lead.issue and word in lead.issue, lead.issue
    assert "no majority" not in lead.issue and "departs from its own history" in lead.issue
    assert lead.confidence >= 0.8


@pytest.mark.timeout(90)
def test_uneven_data_is_named_when_the_short_rank_goes_on_to_a_barrier(tmp_path):
    """Rank 1 has one batch fewer and calls a barrier (wait_for_everyone) while rank 0 waits in
    its next all-reduce: uneven data, not 'a desync, align the code paths'."""
    lead, findings = _run(tmp_path, 2, "kind=uneven", "fault=uneven", "rank=1", "next=barrier")
    assert lead.ranks == [1] and "ran out of data" in lead.issue and "wait_for_everyone" in lead.issue, lead.issue
    assert "DistributedSampler" in lead.fix and not any("desync" in f.issue for f in findings)


@pytest.mark.timeout(90)
def test_healthy_uneven_twin_with_even_data_writes_no_report(tmp_path):
    result = run_ranks(2, ["kind=uneven"], tmp_path, entry=ENTRY, timeout=HARD)
    assert result.codes == [0, 0], result.stderr[-3000:]
    assert not (tmp_path / "hang-report").exists()


@pytest.mark.timeout(90)
def test_an_error_on_every_rank_leads_as_the_error_not_a_hang(tmp_path):
    """Every rank raises in its loss at step 2: the report leads with the exception, not with
    'no progress'."""
    result = run_ranks(2, ["kind=uneven", "fault=raise", "rank=all"], tmp_path, entry=ENTRY, timeout=HARD)
    assert not result.timed_out and 0 not in result.codes, result.stderr[-3000:]
    lead, findings = _findings(tmp_path)
    assert "raised on rank" in lead.issue and "loss is nan at step 2" in lead.issue, [f.issue for f in findings]
    assert _line("FAULT:raise") in lead.evidence


@pytest.mark.timeout(90)
def test_uneven_data_before_accelerates_wait_for_everyone_shows_the_users_line(tmp_path):
    """The short rank calls accelerate's PartialState().wait_for_everyone(): the report shows the
    job's own line, not only accelerate's state.py."""
    pytest.importorskip("accelerate")
    lead, findings = _run(tmp_path, 2, "kind=uneven", "fault=uneven", "rank=1", "next=accelerate")
    assert lead.ranks == [1] and "ran out of data" in lead.issue, lead.issue
    assert _line("FAULT:uneven-accelerate") in lead.issue and "accelerate/state.py" in lead.issue, lead.issue


@pytest.mark.parametrize("world,words,culprits,said", [
    (3, ["fault=order", "rank=2"], [2], "another order"),
    (4, ["fault=order", "rank=0"], [0], "another order"),
    (2, ["fault=members"], [1], "left out [0]"),
    (4, ["fault=members"], [3], "left out [0,1,2]"),
], ids=["order-3-last", "order-4-first", "members-only-2", "members-only-4"])
@pytest.mark.timeout(90)
def test_groups_made_in_another_order_or_by_members_only_blame_the_ranks_that_did(tmp_path, world, words, culprits, said):
    """torch numbers new_group's groups per process: a rank that makes them in another order, or
    skips one it is not a member of, binds a number to other members than its peers. The ranks
    stuck in the group's creation or first collective are not blamed; those that made it
    differently are, by name and members."""
    lead, findings = _run(tmp_path, world, "kind=groups", *words)
    assert lead.ranks == culprits and lead.cause == "desync", (lead.ranks, lead.issue)
    assert said in lead.issue and "group '" in lead.issue, lead.issue
    assert _blamed(findings) == set(culprits), [(f.ranks, f.issue) for f in findings]


@pytest.mark.parametrize("world,fault", [(3, "none"), (4, "local"), (2, "local")])
@pytest.mark.timeout(90)
def test_groups_made_in_one_order_or_hashed_by_members_are_quiet(tmp_path, world, fault):
    """Twins: the same groups made in one order on every rank, or made by their members only
    with use_local_synchronization=True (a name hashed from the members: no order to keep)."""
    result = run_ranks(world, ["kind=groups", f"fault={fault}"], tmp_path, entry=ENTRY, timeout=HARD)
    assert not result.timed_out and result.codes == [0] * world, result.stderr[-3000:]
    assert not (tmp_path / "hang-report").exists()


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("world", "words", "label"), [
    (3, ["in=first"], "ranks[0,1,2] (tp)"),  # the first-made twin: its positions were overwritten by the second's
    (3, ["in=second"], "ranks[0,1,2] (dp)"),
    (2, ["in=first", "desc=tp,tp"], "ranks[0,1] (tp, group 1)"),  # the same desc: torch's group name tells them apart
])
def test_twin_groups_of_the_same_members_are_kept_apart(tmp_path, world, words, label):
    """Two groups of the same members count their collectives apart: a rank stalled before one of
    them is named as never entering that group's collective, the group named by its desc (or its
    name, where the desc is the same too). Before, both were 'ranks[...]': the one made first lost
    its positions to the second, and the report said no rank was inside a collective."""
    lead, findings = _run(tmp_path, world, "kind=twins", "fault=stall", f"rank={world - 1}", "step=2", *words)
    assert lead.ranks == [world - 1], lead.issue
    assert "never entered all_reduce" in lead.issue and f"on {label} that" in lead.issue, lead.issue
    assert _blamed(findings) == {world - 1}, [(f.ranks, f.issue) for f in findings]


@pytest.mark.timeout(90)
def test_healthy_twin_groups_write_no_report(tmp_path):
    result = run_ranks(3, ["kind=twins"], tmp_path, entry=ENTRY, timeout=HARD)
    assert not result.timed_out and result.codes == [0, 0, 0], result.stderr[-3000:]
    assert not (tmp_path / "hang-report").exists()


@pytest.mark.torchrun
@pytest.mark.timeout(150)
def test_zero_code_twin_groups_name_the_rank_that_never_entered(cli_env, tmp_path):
    """The same under torchrun -m distdiag.watch (the recorder's positions alone, no wrappers):
    with the twins under one label the report said no rank was inside a collective."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--standalone",
           "-m", "distdiag.watch", "--timeout-s", "3", "--", str(SCRIPT), "kind=twins", "fault=stall", "rank=2",
           "step=2", "in=first"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stderr[-3000:]
    lead, findings = _findings(tmp_path)
    assert lead.ranks == [2] and "on ranks[0,1,2] (tp) that" in lead.issue, lead.issue
    assert _blamed(findings) == {2}, [(f.ranks, f.issue) for f in findings]
