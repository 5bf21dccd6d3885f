"""The watchdog's healthy twins stay silent with the CPU saturated (issue 24: healthy jobs were
aborted at load 4-6), and a real hang is still named there.

Each run starts 3 busy-loop processes beside the ranks (tests/faults/busy.py: bounded
lifetime, killed on the way out). Before the fix the 3-rank DDP checkpoint twin failed 3 runs
in 6 beside 5 busy loops: rank 0 waited in DDP's all_gather #1 past the 3 s timeout while
ranks 1-2 were still importing torch.distributed.tensor, and every rank exited 3.
"""

from __future__ import annotations

import pytest

from distdiag.report.model import read_report
from tests.faults.busy import busy_cpus
from tests.harness import run_ranks

ENGINE = "tests.faults.engine_workers:train"
WORKERS = "tests.faults.watchdog_workers:train"
HARD = 100.0
BUSY = 3


@pytest.mark.parametrize(
    "entry,world,words",
    [
        (ENGINE, 3, ["kind=ddp", "ckpt=5"]),
        (ENGINE, 3, ["kind=ddp", "compute=4.5"]),
        (WORKERS, 2, ["fault=checkpoint", "rank=1", "step=2", "steps=5"]),
        (WORKERS, 2, ["fault=slow_step", "rank=1", "step=2", "steps=5"]),
        (ENGINE, 3, ["kind=ddp", "import=5", "rank=2"]),
    ],
    ids=["ddp-checkpoint-phase", "ddp-long-compute", "checkpoint-phase", "slow-step", "ddp-rank-still-importing"],
)
@pytest.mark.timeout(150)
def test_healthy_twins_stay_silent_beside_busy_loops(tmp_path, entry, world, words):
    """A declared checkpoint, long compute, a slower step, and rank 2 importing for 5 s (the 3 s
    timeout) while ranks 0-1 wait in DDP's first all_gather - the starting rank is not hung
    (this one failed every time before the fix, load or not): every rank exits 0, no report."""
    with busy_cpus(BUSY):
        result = run_ranks(world, words, tmp_path, entry=entry, timeout=HARD)
    assert not result.timed_out and result.codes == [0] * world, (result.codes, result.stderr[-3000:])
    assert not (tmp_path / "hang-report").exists()


@pytest.mark.timeout(150)
def test_a_blocked_rank_is_still_named_beside_busy_loops(tmp_path):
    """The fault twin: rank 1 blocks outside any collective at step 2; under the same load it is
    named (the startup excuses end once every rank checked in and no rank imports)."""
    with busy_cpus(BUSY):
        result = run_ranks(2, ["fault=block", "rank=1", "step=2"], tmp_path, entry=WORKERS, timeout=HARD)
    assert not result.timed_out and result.codes == [3, 3], (result.codes, result.stderr[-3000:])
    report = read_report(tmp_path / "hang-report" / "hang-report.json")
    crit = [f for f in report.probe("watchdog").findings if f.severity == "critical"]
    assert crit[0].ranks == [1] and "FAULT:block" in crit[0].issue, crit[0]
