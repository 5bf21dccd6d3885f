"""The built-in workloads and moe_routing's own data at every world size from 1 to 64 (no processes)."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from distdiag.check.target import load_target
from distdiag.probes import training as tr
from distdiag.probes.moe.checks import BUILTIN_ROUTER, consolidate_moe, load_findings, load_noise
from distdiag.probes.moe.probe import MoeRoutingConfig, _router_checks
from distdiag.probes.numerics.parity_report import setup_failure
from distdiag.workloads import fit_world, get_workload
from distdiag.workloads.moe import DenseMoE

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


def _uniform_indices(tokens: int, experts: int, k: int, rng: random.Random) -> list[list[int]]:
    return [rng.sample(range(experts), k) for _ in range(tokens)]


def test_a_uniform_router_sampling_noise_is_not_a_warning():
    """Random uniform top-k routing of few tokens over many experts: idle and busy experts are noise, so info."""
    rng = random.Random(0)
    warned = 0
    for experts in (4, 8, 16, 32, 64, 128):
        for tokens in (16, 64, 256):
            for _ in range(20):
                findings = load_findings("route", _uniform_indices(tokens, experts, 2, rng), experts, 3.0)
                warned += any(f.severity == "warning" for f in findings)
    assert warned == 0


def test_a_load_that_noise_cannot_explain_is_still_a_warning():
    """Every token to experts 0 and 1 of 8, and 20 tokens never reaching experts 2-3 of 4, are warnings."""
    collapsed = load_findings("route", [[0, 1]] * 64, 8, 3.0)
    assert {f.severity for f in collapsed} == {"warning"}
    assert any("collapses" in f.issue for f in collapsed) and any("6 of 8 experts get no tokens" in f.issue for f in collapsed)
    idle, busy = load_noise([64, 64, 0, 0, 0, 0, 0, 0], 64)
    assert idle < 1e-6 and busy < 1e-6


def _builtin_router_payloads(world: int, opts: MoeRoutingConfig) -> dict[int, dict]:
    """Every rank's router checks of the built-in router, as moe_routing's run makes them."""
    ctx = SimpleNamespace(device=torch.device("cpu"), seed=lambda: torch.manual_seed(1234), caught=None)
    ctx.seed()
    dense = DenseMoE(opts.hidden_dim, 2 * opts.hidden_dim, 2 * world, opts.top_k)
    res = _router_checks(ctx, opts, dense.router, BUILTIN_ROUTER)
    return {r: {"router": res, "builtin": {}} for r in range(world)}


@pytest.mark.parametrize("world", [16, 32, 64])
def test_moe_routing_own_random_router_raises_no_warning_at_many_ranks(world):
    """2 x world experts routed by distdiag's random router on its own tokens: the load is an info, never a warning."""
    opts = MoeRoutingConfig()
    findings = consolidate_moe(_builtin_router_payloads(world, opts), opts, world)
    assert [f.issue for f in findings if f.severity != "info"] == []
    (load,) = [f for f in findings if "load per expert" in f.issue]
    assert "not judged: this is distdiag's own router" in load.evidence


TARGETS = Path(__file__).resolve().parents[1] / "faults" / "targets"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize(
    "path,says",
    [
        (TARGETS / "sp_healthy.py", "sequence-parallel layout (split_sequence(), parallelize_sp()"),
        (TARGETS / "moe_healthy.py", "declares route(), a mixture-of-experts layout"),
        (CONFIGS / "example_sp_moe_target.py", "declares route()"),
        (CONFIGS / "example_target.py", None),
        (TARGETS / "per_rank_loss.py", None),
    ],
    ids=lambda v: v.name if isinstance(v, Path) else "",
)
def test_numerics_probes_skip_targets_whose_layout_is_not_data_parallel(path, says):
    """SP-only and MoE targets: the numerics probes skip naming the layout; data-parallel targets still run."""
    reason = tr.layout_reason(SimpleNamespace(target=load_target(str(path))), "loss_parity")
    if says is None:
        assert reason is None
    else:
        assert reason.startswith(f"probe 'loss_parity' does not apply to target {path}") and says in reason
    assert tr.layout_reason(SimpleNamespace(target=None), "loss_parity") is None
