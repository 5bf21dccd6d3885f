"""Before a process may end, our last collective's tensor is let go by gloo's worker thread.

Torch's gloo worker drops a finished work (and the tensors it holds) a moment after the caller's
wait returns; if the interpreter is finalizing by then, that thread's request for the GIL ends it
with pthread_exit and the process aborts ("terminate called without an active exception",
SIGABRT; seen on loaded CI at the end of healthy scripts whose last collective was the monitor's
close). Real gloo process groups, 2 ranks."""

from __future__ import annotations

import json

import pytest

from tests.harness import run_ranks

ENTRY = "tests.dist.settle_worker:main"


def _run(tmp_path, scenario: str, world: int = 2) -> list[dict]:
    result = run_ranks(world, [scenario, str(tmp_path)], tmp_path, entry=ENTRY, timeout=90)
    assert not result.timed_out and result.codes == [0] * world, (result.codes, [o.stderr[-2000:] for o in result.outcomes])
    return [json.loads((tmp_path / f"settle{r}.json").read_text()) for r in range(world)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_wait_released_returns_once_gloo_let_go(tmp_path, world):
    """Every all_reduce's tensor is released by gloo within the wait, on every rank (how many were
    still held when the call returned is what makes the wait necessary: printed, not asserted,
    as it depends on scheduling)."""
    per_rank = _run(tmp_path, "collectives", world)
    for rank, out in enumerate(per_rank):
        assert out["released"] == out["calls"], (rank, out)
    print("held when all_reduce returned:", [out["held_on_return"] for out in per_rank], "of 40")


@pytest.mark.timeout(120)
def test_monitor_close_waits_for_its_last_collective(tmp_path):
    """close()'s last look (the last collective of many scripts) waits until gloo let go of its
    tensor; the looks during training do not wait (no cost on the hot path), the latest one is
    remembered for the handler that runs at exit when a script never calls close()."""
    for rank, out in enumerate(_run(tmp_path, "monitor_close")):
        assert out["waits_during_loop"] == 0, (rank, out)
        assert out["waits_at_close"] == [True], (rank, out)
        # without close(): the last look is remembered and settled by the atexit handler
        assert out["remembered"] == 1 and out["settled_at_exit"], (rank, out)


@pytest.mark.timeout(120)
def test_gloo_workers_idle_before_exit(tmp_path):
    """The wait at exit (an atexit handler under the watchdog, the monitor and `distdiag watch`)
    returns once gloo's workers are asleep with nothing run for a while: after DDP's own gradient
    all_reduces (issued in C++, no tensor of ours to watch) and after an all_reduce; while a
    collective waits for a peer that has not entered it, the worker blocked in the network is
    idle too, so the wait never hangs on a stuck collective."""
    for rank, out in enumerate(_run(tmp_path, "gloo_idle")):
        assert out["workers"] >= 1, (rank, out)  # torch names them pt_gloo_runloop: seen in /proc
        for key in ("after_ddp", "after_all_reduce"):
            ok, seconds, states = out[key]
            assert ok and set(states) <= {"S", "D"}, (rank, key, out)
        if rank == 0:
            assert out["pending"][0], (rank, out)  # quiet before its 1 s bound, not timed out
