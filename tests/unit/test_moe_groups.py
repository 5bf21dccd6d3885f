"""moe_routing's built-in layer in expert-parallel groups (issue 21): at 16k ranks a layer over
the whole job posted ~1 MB a rank and gathered a 4 GB split table per all_to_all. Its groups are
up to 8 consecutive ranks; what a rank posts is bounded by its group, and the consolidation
pairs senders and receivers within each group."""

from __future__ import annotations

import json

import pytest

from distdiag.errors import ConfigError
from distdiag.probes.base import ConsolidationView
from distdiag.probes.moe.checks import consolidate_moe
from distdiag.probes.moe.probe import MoeRoutingConfig, MoeRoutingProbe, ep_size_for
from tests.unit.check_payloads import rank_infos
from tests.unit.check_suite_payloads import moe_routing


@pytest.mark.parametrize(("world", "size"), [(2, 2), (4, 4), (8, 8), (12, 6), (16, 8), (48, 8), (13, 13), (143, 143),
                                             (16384, 8), (24576, 8), (9, 3)])
def test_the_group_is_the_largest_divisor_up_to_8_or_the_world(world, size):
    assert ep_size_for(world) == size


def test_an_ep_size_that_does_not_divide_the_world_is_bad_input():
    assert ep_size_for(8, 2) == 2
    with pytest.raises(ConfigError, match=r"ep_size \(3\) must divide the world size 8"):
        ep_size_for(8, 3)
    with pytest.raises(ConfigError):
        MoeRoutingConfig(ep_size=-1)


def _errors(payloads, world):
    return [f for f in consolidate_moe(payloads, MoeRoutingConfig(), world) if f.severity in ("error", "critical")]


@pytest.mark.parametrize("world", [48, 4096])
def test_grouped_healthy_payloads_are_silent_and_a_lost_token_names_its_pair(world):
    assert _errors(moe_routing(world, "healthy", ep=8), world) == []
    (lost,) = _errors(moe_routing(world, "lost_tokens", ep=8), world)
    assert "tokens lost or duplicated" in lost.issue
    sent = moe_routing(world, "healthy", ep=8)[3]["builtin"]["stats"]["sent_valid"][5]
    assert lost.evidence == f"rank 3 sent {sent} tokens to rank 5, which received {sent - 1}"


def test_a_lost_token_in_a_later_group_is_named_there():
    """Rank 45 (group 40-47) received one token fewer from rank 42: the pair is named by rank."""
    payloads = moe_routing(48, "healthy", ep=8)
    payloads[45]["builtin"]["stats"]["recv_valid"][2] -= 1
    (lost,) = _errors(payloads, 48)
    assert lost.evidence.startswith("rank 42 sent ") and lost.evidence.endswith(" to rank 45, which received "
                                                                               f"{payloads[45]['builtin']['stats']['recv_valid'][2]}")


def test_what_a_rank_posts_does_not_grow_with_the_job():
    small, large = (len(json.dumps(moe_routing(w, "healthy", ranks=[0], ep=8)[0])) for w in (16, 4096))
    assert large == small


def test_the_dispatch_table_says_each_rows_group():
    world = 16
    result = MoeRoutingProbe().consolidate(moe_routing(world, "healthy", ep=8),
                                           ConsolidationView(world, rank_infos(world), MoeRoutingConfig()))
    rows = result.details["table:moe_dispatch"]
    assert [r["group"] for r in rows] == ["ranks 0-7"] * 8 + ["ranks 8-15"] * 8
    assert all(len(r["sent"]) == len(r["received"]) == 8 for r in rows)
