"""param_sync's holders of each tensor at HSDP shapes (issue 21): with every shard held by a few
replicas, the one pass over the ranks' keys must pair exactly the copies of each shard. The
payloads are what the real probe posted on 4 ranks (tests/unit/check_suite_templates.json),
re-keyed as 3 shards x 2 replicas on 6 ranks and 5 shards x 3 replicas on 15: not powers of two."""

from __future__ import annotations

import json

import pytest

from distdiag.probes import PROBES
from distdiag.probes.base import ConsolidationView
from distdiag.probes.numerics.param_sync import _replicated
from tests.unit.check_payloads import rank_infos
from tests.unit.check_suite_payloads import CAPTURED, _texts


def _hsdp(world: int, shards: int, drifting: int | None) -> dict[int, dict]:
    """Rank r holds shard r % shards (its replicas: the ranks with the same remainder), posting
    what a captured rank posted; the drifting rank's copy of its shard differs from step 1 on."""
    out = {}
    for r in range(world):
        k = (r % shards) % CAPTURED  # the replicas of a shard post the same captured sums
        text = _texts()[f"param_sync/{k}"].replace(f"[shard dp={k}]", f"[shard dp={r % shards}]")
        out[r] = json.loads(text)
    if drifting is not None:
        for snap in out[drifting]["snaps"][1:]:
            key = next(k for k in snap["sums"] if k.endswith(f"[shard dp={drifting % shards}]"))
            kind, bits, total = snap["sums"][key]
            snap["sums"][key] = [kind, "0badc0de" + bits[8:], total + 1.0]
    return out


@pytest.mark.parametrize("world,shards", [(6, 3), (15, 5)])
def test_each_shard_is_compared_among_its_replicas_only(world, shards):
    payloads = _hsdp(world, shards, None)
    holding = _replicated([payloads[r]["snaps"][0]["sums"] for r in range(world)])
    for key, at in holding.items():
        if "[shard dp=" in key:
            j = int(key.rsplit("dp=", 1)[1].rstrip("]"))
            assert at == list(range(j, world, shards)), key
        else:
            assert at == list(range(world)), key  # a buffer: every rank holds it


@pytest.mark.parametrize("world,shards,drifting,named", [(6, 3, 4, [1, 4]), (15, 5, 7, [7])])
def test_a_drifting_replica_is_named_and_the_healthy_twin_is_silent(world, shards, drifting, named):
    """Two replicas disagreeing: both are named (no majority); three: the odd one."""
    probe = PROBES["param_sync"]()
    view = ConsolidationView(world, rank_infos(world), probe.Config())
    healthy = probe.consolidate(_hsdp(world, shards, None), view)
    assert [f.issue for f in healthy.findings if f.severity != "info"] == []
    broken = probe.consolidate(_hsdp(world, shards, drifting), view)
    errors = [f for f in broken.findings if f.severity == "error"]
    assert len(errors) == 1 and errors[0].ranks == named, [f.issue for f in errors]
    assert "after step 1" in errors[0].issue
