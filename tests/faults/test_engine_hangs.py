"""Hangs in collectives torch issues itself - DDP's reducer, FSDP2, a compiled graph - are named.

Issue 11: progress and position come from torch's flight recorder, so the watchdog needs no
Python wrapper to see them. Each fault runs under the in-code API (forked gloo ranks, store
in the parent) and under the zero-code wrapper (`torchrun -m distdiag.watch -- script`, the
script unchanged, steps from torch's optimizer hook); each has a healthy twin that must write
no report. Watchdog timeouts are 3 s (8 s for the evaluation twin); bounds are wide on
purpose (2 loaded cores).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from distdiag.report.model import read_report
from tests.harness import run_ranks

ENTRY = "tests.faults.engine_workers:train"
SCRIPT = Path(__file__).parent / "engine_workers.py"
HARD = 60.0


def _line(marker: str) -> str:
    text = SCRIPT.read_text().splitlines()
    return f"{SCRIPT.name}:{next(i for i, line in enumerate(text, 1) if marker in line)}"


def _lead(workdir: Path):
    report = read_report(workdir / "hang-report" / "hang-report.json")
    probe = report.probe("watchdog")
    crit = [f for f in probe.findings if f.severity == "critical"]
    assert crit, probe.findings
    return report, probe, crit[0]


def _code(tmp_path: Path, world: int, *words: str):
    return run_ranks(world, list(words), tmp_path, entry=ENTRY, timeout=HARD)


def _watch(cli_env: dict[str, str], tmp_path: Path, world: int, timeout_s: float, *words: str) -> tuple[subprocess.CompletedProcess[str], float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--standalone",
           "-m", "distdiag.watch", "--timeout-s", str(timeout_s), "--", str(SCRIPT), *words]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=120)
    return proc, time.monotonic() - started


def _assert_uneven(lead, short: int) -> None:
    assert lead.ranks == [short], lead.issue
    assert "stopped taking training steps" in lead.issue and "save_checkpoint" in lead.issue
    assert "DistributedSampler" in lead.fix and "Join" in lead.fix


def _assert_unused(lead, bad: int) -> None:
    assert lead.ranks == [bad], lead.issue
    assert "Expected to have finished reduction" in lead.issue and "left waiting in" in lead.issue
    assert "find_unused_parameters" in lead.fix


def _assert_blocked(lead, bad: int) -> None:
    assert lead.ranks == [bad], lead.issue
    assert "never entered" in lead.issue and _line("FAULT:block") in lead.issue


# -- in-code API ------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_ddp_uneven_data_names_the_rank_that_left_the_loop(tmp_path):
    """Rank 2 has one batch fewer and writes its checkpoint; ranks 0,1 wait in DDP's all-reduce
    inside backward(), which no wrapper sees. No step marks: optimizer steps are counted."""
    result = _code(tmp_path, 3, "kind=ddp", "fault=uneven", "rank=2", "steps=4")
    assert result.codes == [3, 3, 3], result.stderr[-3000:]
    report, probe, lead = _lead(tmp_path)
    _assert_uneven(lead, 2)
    assert probe.details["steps"]["per_rank"] == {"0": 3, "1": 3, "2": 3}  # optimizer steps completed
    rows = {r["rank"]: r for r in probe.details["table:ranks at the end"]}
    assert rows[0]["state"] == "collective" and "backward" in rows[0]["where"]


@pytest.mark.timeout(90)
def test_ddp_unused_parameter_the_raising_rank_leads(tmp_path):
    """Rank 1 leaves head_b out of its loss at step 2; DDP raises on rank 1 at the next forward
    while ranks 0,2 wait in the all-reduce rank 1 never launched."""
    result = _code(tmp_path, 3, "kind=ddp", "fault=unused", "rank=1", "step=2")
    assert result.codes == [3, 1, 3], result.stderr[-3000:]
    _, _, lead = _lead(tmp_path)
    _assert_unused(lead, 1)
    assert "RuntimeError" in result.outcomes[1].stderr  # the rank's own exception still reaches its log


@pytest.mark.timeout(90)
def test_fsdp2_rank_blocked_in_data_loading_is_named(tmp_path):
    """Rank 1 blocks before its forward; rank 0 waits in FSDP2's all-gather."""
    result = _code(tmp_path, 2, "kind=fsdp", "fault=block", "rank=1", "step=2")
    assert result.codes == [3, 3], result.stderr[-3000:]
    _, _, lead = _lead(tmp_path)
    _assert_blocked(lead, 1)


@pytest.mark.timeout(120)
def test_compiled_step_hang_is_seen_by_the_recorder(tmp_path):
    """The gradient all-reduce is a functional collective inside a torch.compile'd graph."""
    result = _code(tmp_path, 2, "kind=compile", "fault=block", "rank=1", "step=2")
    assert result.codes == [3, 3], result.stderr[-3000:]
    _, probe, lead = _lead(tmp_path)
    _assert_blocked(lead, 1)
    assert "all_reduce" in lead.issue


@pytest.mark.timeout(120)
def test_desync_inside_a_compiled_graph_is_found_from_the_recorder(tmp_path):
    """Rank 1's compiled graph all-gathers where ranks 0,2 all-reduce: no wrapper sees either
    call; the recorder shows them at the same sequence number with different ops."""
    result = _code(tmp_path, 3, "kind=compile", "fault=op_mismatch", "rank=1", "step=2")
    assert not result.timed_out and result.codes == [3, 3, 3], result.stderr[-3000:]
    _, _, lead = _lead(tmp_path)
    assert lead.ranks == [1] and "desync" in lead.issue
    assert "all_gather" in lead.issue and "all_reduce" in lead.issue


@pytest.mark.parametrize(
    "words",
    [
        ["kind=ddp", "eval=4", "timeout=8"],
        ["kind=ddp", "compute=4.5"],
        ["kind=ddp", "ckpt=5"],
        ["kind=fsdp", "compute=4.5"],
        ["kind=compile", "compute=4.5"],
    ],
    ids=["ddp-rank0-eval-4s-timeout-8s", "ddp-long-compute", "ddp-checkpoint-phase", "fsdp-long-compute", "compiled-step"],
)
@pytest.mark.timeout(120)
def test_healthy_twins_in_code_write_no_report(tmp_path, words):
    """Rank 0 evaluates for 4 s while the others wait in the next all-reduce (timeout 8 s); every
    rank computes 1.5x the timeout without a collective; rank 0 saves for 5 s in a declared
    phase; FSDP2; a compiled step (its compilation is a phase of its own)."""
    world = 3 if "kind=ddp" in words else 2
    result = _code(tmp_path, world, *words)
    assert result.codes == [0] * world, result.stderr[-3000:]
    assert not (tmp_path / "hang-report").exists()


# -- zero-code wrapper ------------------------------------------------------------------------


@pytest.mark.torchrun
@pytest.mark.parametrize(
    "world,words,check",
    [
        (3, ["kind=ddp", "fault=uneven", "rank=2", "steps=4"], lambda lead: _assert_uneven(lead, 2)),
        (3, ["kind=ddp", "fault=unused", "rank=1"], lambda lead: _assert_unused(lead, 1)),
        (2, ["kind=fsdp", "fault=block", "rank=1"], lambda lead: _assert_blocked(lead, 1)),
        (2, ["kind=compile", "fault=block", "rank=1"], lambda lead: _assert_blocked(lead, 1)),
    ],
    ids=["ddp-uneven", "ddp-unused-parameter", "fsdp2-blocked", "compiled-blocked"],
)
@pytest.mark.timeout(150)
def test_zero_code_wrapper_names_the_culprit(cli_env, tmp_path, world, words, check):
    """The same faults in an unchanged script under torchrun -m distdiag.watch."""
    proc, elapsed = _watch(cli_env, tmp_path, world, 3, *words)
    assert proc.returncode != 0, proc.stderr[-3000:]
    _, _, lead = _lead(tmp_path)
    check(lead)
    assert elapsed < 90


@pytest.mark.torchrun
@pytest.mark.parametrize(
    "world,timeout_s,words",
    [
        (3, 8, ["kind=ddp", "eval=4"]),
        (2, 3, ["kind=fsdp", "compute=4.5"]),
        (2, 3, ["kind=compile", "compute=4.5"]),
    ],
    ids=["ddp-rank0-eval", "fsdp-long-compute", "compiled-step"],
)
@pytest.mark.timeout(150)
def test_zero_code_healthy_twins_exit_zero_without_report(cli_env, tmp_path, world, timeout_s, words):
    proc, _ = _watch(cli_env, tmp_path, world, timeout_s, *words)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "hang-report").exists()
