"""The watchdog's incident across nodes (issue 21 item 2): 4 gloo ranks on 2 pretend nodes
(GROUP_RANK 0 and 1, LOCAL_RANK 0-1: tests/harness.py `hosts=2`). Each node's local rank 0
that is not the writer posts its node's snapshots as one value (distdiag/runtime/nodes.py);
the writer reads those and the rest one by one. The culprit is named as on one node, and the
healthy twin on two nodes is quiet."""

from __future__ import annotations

import pytest

from distdiag.report.model import read_report
from tests.faults.test_watchdog_faults import ENTRY, HARD_TIMEOUT, _line
from tests.harness import run_ranks


@pytest.mark.parametrize("world,hosts,culprit", [(4, 2, 3), (6, 3, 4)], ids=["4-ranks-2-nodes", "6-ranks-3-nodes"])
@pytest.mark.timeout(60)
def test_a_rank_blocked_on_another_node_is_named_from_its_leaders_value(tmp_path, world, hosts, culprit):
    """A rank on a node after the first (local rank 1 there) blocks outside any collective:
    every rank's snapshot reaches the writer, a node's at least through its leader (a leader
    later than the writer's 1 s wait on a loaded machine leaves its node to be read one by one),
    and the culprit alone is blamed."""
    result = run_ranks(world, ["fault=block", f"rank={culprit}", "step=2"], tmp_path, entry=ENTRY,
                       timeout=HARD_TIMEOUT, hosts=hosts)
    assert not result.timed_out, result.stderr[-3000:]
    assert [o.exitcode for o in result.outcomes] == [3] * world, result.stderr[-3000:]
    report = read_report(result.workdir / "hang-report" / "hang-report.json")
    probe = report.probe("watchdog")
    crit = [f for f in probe.findings if f.severity == "critical"]
    assert crit[0].ranks == [culprit] and _line("FAULT:block") in crit[0].issue
    gathered = probe.details["gathered"]
    per_node = world // hosts
    assert gathered["from_node_leaders"] + gathered["one_by_one"] == world, gathered
    assert gathered["from_node_leaders"] >= per_node, gathered
    assert {r["rank"] for r in probe.details["table:ranks at the end"]} == set(range(world))


@pytest.mark.timeout(60)
def test_a_slow_step_on_two_nodes_is_no_hang(tmp_path):
    result = run_ranks(4, ["fault=slow_step", "rank=3", "step=2", "steps=5"], tmp_path, entry=ENTRY,
                       timeout=HARD_TIMEOUT, hosts=2)
    assert result.codes == [0, 0, 0, 0], result.stderr[-3000:]
    assert not (tmp_path / "hang-report").exists()
