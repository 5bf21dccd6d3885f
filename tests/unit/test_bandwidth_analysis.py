"""bandwidth: nccl-tests conventions, config validation, straggler and slow-link attribution (pure)."""

from __future__ import annotations

import pytest

from distdiag.errors import ConfigError
from distdiag.probes.base import ConsolidationView
from distdiag.probes.cluster.bandwidth import (
    BandwidthConfig,
    BandwidthProbe,
    bus_factor,
    format_size,
    parse_size,
    slow_links,
    straggler_scores,
)
from distdiag.report.model import RankInfo


def _view(n: int, hosts: list[str] | None = None, opts: BandwidthConfig | None = None) -> ConsolidationView:
    hosts = hosts or [f"node{r // 2}" for r in range(n)]
    ranks = [RankInfo(r, hosts[r], r // 2, r % 2, "cpu", 100 + r) for r in range(n)]
    return ConsolidationView(world_size=n, ranks=ranks, options=opts or BandwidthConfig())


def test_bus_factors_follow_nccl_tests():
    """all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast 1."""
    assert bus_factor("all_reduce", 8) == pytest.approx(1.75)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bus_factor(op, 8) == pytest.approx(0.875)
    assert bus_factor("broadcast", 8) == 1.0


def test_sizes_parse_with_units_and_bad_ones_name_the_key():
    """4KiB, 1MB, 4096 parse to bytes; junk is a ConfigError naming the dotted key."""
    assert parse_size("4KiB") == 4096 and parse_size("1MB") == 10**6 and parse_size(4096) == 4096
    assert format_size(2**20) == "1MiB" and format_size(1000) == "1000B"
    with pytest.raises(ConfigError, match=r"probes\.bandwidth\.sizes.*'4 parsecs'"):
        BandwidthConfig(sizes=["4 parsecs"])
    with pytest.raises(ConfigError, match=r"probes\.bandwidth\.ops"):
        BandwidthConfig(ops=["all_reduce", "gossip"])
    with pytest.raises(ConfigError, match=r"expected_busbw_gbps\.64MiB\.all_reduce must be GB/s > 0"):
        BandwidthConfig(expected_busbw_gbps={"64MiB": {"all_reduce": -1}})


def test_expected_sizes_join_the_sweep_and_defaults_depend_on_the_device():
    """A size named in expected_busbw_gbps is measured even if the sweep leaves it out."""
    opts = BandwidthConfig(expected_busbw_gbps={"8MiB": 10})
    assert 8 * 2**20 in opts.resolved(gpu=False)["sizes"]
    assert opts.resolved(gpu=True)["sizes"][-1] == 2**30
    assert opts.resolved(gpu=False)["iters"] < opts.resolved(gpu=True)["iters"]


def test_a_gpu_clusters_floors_do_not_run_gigabytes_on_cpu():
    """configs/example_gate_cluster.toml (floors at 256MiB and 1GiB): a CPU run times only the CPU
    sweep and says which floors it left unchecked; on GPU the floors' sizes join the sweep."""
    from pathlib import Path

    from distdiag.check.plan import make_plan, parse_config

    example = Path(__file__).resolve().parents[2] / "configs" / "example_gate_cluster.toml"
    plan = make_plan(parse_config(["--profile", "gate", "--config", str(example)]), 2)
    (opts,) = [p.options for p in plan.probes if p.probe.name == "bandwidth"]
    assert max(opts.resolved(gpu=False)["sizes"]) == 4 * 2**20
    assert {256 * 2**20, 2**30} <= set(opts.resolved(gpu=True)["sizes"])
    result = BandwidthProbe().consolidate({r: _payload(0.001, 0.01) for r in range(2)}, _view(2, opts=opts))
    (note,) = [f for f in result.findings if "not checked" in f.issue]
    assert note.severity == "info" and "256MiB, 1GiB" in note.issue and "4KiB" in note.evidence


def test_a_floor_within_the_cpu_cap_or_listed_in_sizes_runs_on_cpu():
    """8MiB (under the 16MiB cap) and a 64MiB size listed in `sizes` are timed on CPU; nothing is left unchecked."""
    opts = BandwidthConfig(sizes=["64MiB"], expected_busbw_gbps={"8MiB": 1.0, "64MiB": 1.0})
    assert opts.resolved(gpu=False)["sizes"] == [8 * 2**20, 64 * 2**20]
    payloads = {r: {"samples": [{"op": "all_reduce", "size": size, "bytes": size, "iters": 10, "total_s": 0.1,
                                 "incall_s": 0.01} for size in (8 * 2**20, 64 * 2**20)], "links": []} for r in range(2)}
    result = BandwidthProbe().consolidate(payloads, _view(2, opts=opts))
    assert not [f for f in result.findings if "not checked" in f.issue]


def _payload(incall: float, total: float, ops=("all_reduce", "all_gather", "broadcast")) -> dict:
    return {"samples": [{"op": op, "size": 4096, "bytes": 4096, "iters": 10, "total_s": total, "incall_s": incall}
                        for op in ops], "links": []}


def test_the_late_rank_scores_high_and_the_on_time_ranks_near_zero():
    """Rank 3 waited least (it arrived late): its score is its lateness over the median iteration."""
    payloads = {r: _payload(0.011, 0.12) for r in range(4)}
    payloads[3] = _payload(0.001, 0.12)
    scores = straggler_scores(payloads)
    assert scores[3]["score"] == pytest.approx(0.010 / 0.012, rel=1e-6)
    assert scores[3]["late_s"] == pytest.approx(0.010)
    assert all(scores[r]["score"] == 0 for r in range(3))


def test_two_ranks_the_late_one_is_named():
    """With 2 ranks the reference is the one that waited, so the late rank still scores."""
    scores = straggler_scores({0: _payload(0.009, 0.1), 1: _payload(0.0005, 0.1)})
    assert scores[1]["score"] > 0.8 and scores[0]["score"] == 0


def _links(times: dict[tuple[int, int], float]) -> list[dict]:
    return [{"pair": list(p), "bytes": 2**20, "time_s": t} for p, t in times.items()]


def test_one_slow_link_names_its_pair_and_hosts():
    """Only link 1<->2 is slow: the pair and both hosts are named, no single rank."""
    n = 4
    times = {(0, 1): 0.001, (1, 2): 0.006, (2, 3): 0.001, (3, 0): 0.0011}
    rows, findings = slow_links(_links(times), n, BandwidthConfig(), _view(n), gpu=True)
    (f,) = findings
    assert f.ranks == [1, 2] and "host node0" in f.issue and "host node1" in f.issue
    assert f.severity == "warning"
    assert [r["link"] for r in rows] == ["0<->1", "1<->2", "2<->3", "3<->0"]


def test_a_slow_rank_is_named_when_both_its_links_are_slow():
    """Links 1<->2 and 2<->3 slow: rank 2 is the common end, named alone (three ranks suffice)."""
    for n, times in (
        (4, {(0, 1): 0.001, (1, 2): 0.005, (2, 3): 0.005, (3, 0): 0.001}),
        (3, {(0, 1): 0.005, (1, 2): 0.005, (2, 0): 0.001}),
    ):
        _, findings = slow_links(_links(times), n, BandwidthConfig(), _view(n), gpu=True)
        (f,) = findings
        assert f.ranks == ([2] if n == 4 else [1]), (n, f.issue)
        assert "both its ring links are slow" in f.issue


def test_cpu_defaults_ignore_a_few_ms_of_scheduling_noise():
    """On CPU a link 4 ms slower (5x) is a descheduled rank, not a slow link; 30 ms is named."""
    times = {(0, 1): 0.001, (1, 2): 0.005, (2, 3): 0.001, (3, 0): 0.001}
    assert slow_links(_links(times), 4, BandwidthConfig(), _view(4))[1] == []
    times[(1, 2)] = 0.031
    assert [f.ranks for f in slow_links(_links(times), 4, BandwidthConfig(), _view(4))[1]] == [[1, 2]]


def test_healthy_links_and_the_expected_floor():
    """Even links give nothing; a link under expected_p2p_gbps is an error naming the pair."""
    times = {(0, 1): 0.001, (1, 2): 0.0012, (2, 3): 0.001, (3, 0): 0.001}
    assert slow_links(_links(times), 4, BandwidthConfig(), _view(4))[1] == []
    opts = BandwidthConfig(expected_p2p_gbps=1.0)  # 1 MiB in 1.2 ms is 0.87 GB/s
    _, findings = slow_links(_links(times), 4, opts, _view(4, opts=opts))
    assert [f.ranks for f in findings] == [[1, 2]] and findings[0].severity == "error"
    assert "below the expected 1.0 GB/s" in findings[0].issue


def test_busbw_below_expected_fails_naming_the_straggler_and_its_host():
    """all_reduce 4KiB below its expected busbw: an error naming the straggler rank and host."""
    payloads = {r: _payload(0.011, 0.12) for r in range(4)}
    payloads[3] = _payload(0.001, 0.12)
    opts = BandwidthConfig(expected_busbw_gbps={"4KiB": {"all_reduce": 5.0}})
    result = BandwidthProbe().consolidate(payloads, _view(4, opts=opts))
    assert result.status == "fail"
    (err,) = [f for f in result.findings if f.severity == "error"]
    assert err.ranks == [3] and "all_reduce at 4KiB" in err.issue and "node1" in err.issue
    assert "below the expected 5.0 GB/s" in err.issue
    assert result.metrics["busbw_GBps"]["all_reduce"]["4KiB"] == pytest.approx(4096 / 0.012 / 1e9 * 1.5, rel=1e-3)


def test_repeats_default_by_device_and_bad_values_name_the_key():
    """Three timed loops per (op, size) on CPU, nccl-tests' one on GPU; a negative count is a ConfigError."""
    assert BandwidthConfig().resolved(gpu=False)["repeats"] == 3
    assert BandwidthConfig().resolved(gpu=True)["repeats"] == 1
    assert BandwidthConfig(repeats=7).resolved(gpu=True)["repeats"] == 7
    with pytest.raises(ConfigError, match=r"probes\.bandwidth\.repeats must be an integer"):
        BandwidthConfig(repeats=-1)


def test_a_row_is_the_median_loop_of_the_rank_mean_times():
    """Per loop, the mean over ranks of loop time / iters; the row is the median loop, so one
    descheduled loop (rank 1's third, 10x) neither sets the time nor hides: spread_pct shows it."""
    def payload(totals):
        return {"samples": [{"op": "all_reduce", "size": 4096, "bytes": 4096, "iters": 10,
                             "totals_s": totals, "total_s": sorted(totals)[1], "incall_s": 0.001}], "links": []}

    payloads = {0: payload([0.010, 0.012, 0.011]), 1: payload([0.010, 0.012, 0.100])}
    result = BandwidthProbe().consolidate(payloads, _view(2))
    (row,) = result.details["table:bandwidth"]
    # loop means per call: 1.0 ms, 1.2 ms, 5.55 ms -> median 1.2 ms
    assert row["time_us"] == pytest.approx(1200.0)
    assert row["busbw_GBps"] == pytest.approx(4096 / 1.2e-3 / 1e9, rel=1e-3)
    assert row["loops"] == 3 and row["spread_pct"] == pytest.approx((5.55 - 1.0) / 1.2 * 100, abs=0.1)


def test_payloads_without_loops_still_consolidate():
    """A payload with one total_s (an older distdiag's, or the unit tests above) is one loop."""
    result = BandwidthProbe().consolidate({r: _payload(0.001, 0.01) for r in range(2)}, _view(2))
    assert {row["loops"] for row in result.details["table:bandwidth"]} == {1}
