"""The store requests every rank keeps sending while a job runs (the check's sentinel, the
watchdog's tick): their rate for the whole job stays within the store's budget at any world,
computed by benchmarks/bench_standing.py from distdiag's own interval functions, and a short
run of that benchmark against a real TCPStore sends exactly one request per look, heartbeat
and tick. Timings live in the benchmark (docs/benchmarks.md), not here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_standing  # noqa: E402

from distdiag.runtime.exchange import POLL_BUDGET_OPS_S  # noqa: E402
from distdiag.runtime.sentinel import HEARTBEAT_BUDGET_OPS_S  # noqa: E402

BUDGETED = ("look", "beat", "tick")
"""The streams the intervals scale: the sentinel's look and heartbeat, the watchdog's tick."""


@pytest.mark.parametrize("world", [2, 256, 1024, 2500, 4096, 12_500, 16_384, 65_536])
def test_the_standing_rate_stays_within_the_budget(world):
    plan = bench_standing.streams(world, "both", old=False)
    rate = {kind: world / plan[kind] for kind in BUDGETED}
    assert rate["look"] <= POLL_BUDGET_OPS_S * 1.001
    assert rate["beat"] <= max(HEARTBEAT_BUDGET_OPS_S, world / 0.5) * 1.001
    assert rate["tick"] <= max(POLL_BUDGET_OPS_S, world / 0.5) * 1.001
    if world >= 12_500:  # past it every stream is scaled: the job's total, whatever N
        assert sum(rate.values()) <= (2 * POLL_BUDGET_OPS_S + HEARTBEAT_BUDGET_OPS_S) * 1.001


def test_16k_ranks_cost_a_fraction_of_one_store_core():
    """At 16k ranks the old fixed intervals asked the store for 229k requests a second (more
    than one core of torch's server at 5-10 us a request); the scaled ones for under a quarter
    of that, half a core even at 10 us a request."""
    old = bench_standing.offered(16_384, bench_standing.streams(16_384, "both", old=True))
    new = bench_standing.offered(16_384, bench_standing.streams(16_384, "both", old=False))
    assert old >= 196_608 + 32_768
    assert new <= old / 4
    assert new * 10e-6 < 0.6


@pytest.mark.timeout(90)
def test_a_short_run_against_a_real_store():
    row = bench_standing.measure(256, clients=1, seconds=2.0, mode="both")
    issued = row["issued"]
    assert issued["look"] > 0 and issued["beat"] > 0 and issued["tick"] > 0
    # each look, heartbeat, tick and engine publish is one request to the store, no more
    assert row["requests"] == sum(issued.values())
    assert row["server_us_per_request"] is not None and row["server_us_per_request"] > 0
