"""The built-in workloads and moe_routing's own data at every world size from 1 to 64 (no processes)."""

from __future__ import annotations

import pytest
import torch

from distdiag.probes.numerics.parity_report import setup_failure
from distdiag.workloads import fit_world, get_workload

WORLDS = range(1, 65)


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_every_world_gets_equal_parts_of_the_batch_and_of_every_parameter(name):
    """1..64 ranks: the global batch and dim 0 of every parameter divide by the world (FSDP2 shards evenly)."""
    for world in WORLDS:
        w = get_workload(name, world_size=world)
        batch = w.make_batch(1)
        rows = {int(v.shape[0]) for v in batch.values()}
        assert len(rows) == 1 and rows.pop() % world == 0, (world, w.describe())
        model = w.build_model()
        uneven = {n: list(p.shape) for n, p in model.named_parameters() if p.shape[0] % world}
        assert not uneven, (world, uneven)
        shards = [w.shard_batch(batch, r, world) for r in range(world)]
        assert sum(int(next(iter(s.values())).shape[0]) for s in shards) == int(next(iter(batch.values())).shape[0])


@pytest.mark.parametrize("name", ["mlp", "transformer"])
@pytest.mark.parametrize("world", [3, 5, 7, 16, 63, 64])
def test_mean_of_rank_losses_is_the_global_loss_at_any_world(name, world):
    """What loss_parity compares stays exact: the mean over ranks of the shard losses is the 1-process loss."""
    w = get_workload(name, world_size=world)
    torch.manual_seed(0)
    model = w.build_model()
    batch = w.make_batch(2)
    whole = w.loss_fn(model, w.shard_batch(batch, 0, 1)).item()
    parts = [w.loss_fn(model, w.shard_batch(batch, r, world)).item() for r in range(world)]
    assert sum(parts) / world == pytest.approx(whole, rel=1e-5)


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_worlds_dividing_eight_keep_the_default_sizes(name):
    """At 1, 2, 4 and 8 ranks the transformer is the workload it always was (and the mlp up to 4)."""
    default = get_workload(name).sizes
    worlds = (1, 2, 4, 8) if name == "transformer" else (1, 2, 4)
    for world in worlds:
        assert get_workload(name, world_size=world).sizes == default


def test_sizes_round_up_and_a_bad_world_size_is_named():
    """fit_world rounds each size up to a multiple of the world; 0 or a bool is a ValueError naming it."""
    assert fit_world(3, batch=8, seq=9) == {"batch": 9, "seq": 9}
    assert get_workload("transformer", world_size=7).sizes["dim"] == 28  # a multiple of 7 and of heads=2
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
            fit_world(bad, batch=8)


def _setup_payloads(source: str) -> dict[int, dict]:
    msg = "hook shard_batch raised ValueError: a batch tensor of 8 rows cannot be split evenly across 3 ranks"
    return {r: {"source": source, "setup_error": msg} for r in range(3)}


def test_a_setup_error_does_not_repeat_the_probe_name():
    """The verdict line adds the probe's name; the finding's issue must not start with it too."""
    (f,) = setup_failure("loss_parity", _setup_payloads("target t.py"), "steps").findings
    assert f.issue.startswith("hook shard_batch raised") and "fix the hook named above" in f.fix


def test_the_built_in_workload_failing_does_not_read_as_the_users_hook():
    """A failure with no target names distdiag's workload, and the fix does not send the user to their hook."""
    (f,) = setup_failure("param_sync", _setup_payloads("built-in workload transformer(batch=8)"), "snaps").findings
    assert f.issue.startswith("distdiag's built-in workload failed:")
    assert "not a hook of yours" in f.fix and "fix the hook" not in f.fix
