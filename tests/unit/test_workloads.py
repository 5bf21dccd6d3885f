"""Built-in workloads and the pure helpers of the numerical probes (no processes)."""

from __future__ import annotations

import pytest
import torch

from distdiag.probes import training as tr
from distdiag.probes.numerics.replicas import bit_checksum
from distdiag.workloads import TinyMLP, TinyTransformer, get_workload, split_batch


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_mean_of_rank_losses_is_the_global_loss(name):
    """Losses normalised by the global count: the mean over ranks of the shard losses is the global loss."""
    w = get_workload(name)
    torch.manual_seed(0)
    model = w.build_model()
    batch = w.make_batch(1)
    whole = w.loss_fn(model, w.shard_batch(batch, 0, 1)).item()
    for world in (2, 4):
        parts = [w.loss_fn(model, w.shard_batch(batch, r, world)).item() for r in range(world)]
        assert sum(parts) / world == pytest.approx(whole, rel=1e-6)


def test_transformer_shards_hold_different_token_counts():
    """The transformer batch is uneven on purpose (that is what per-rank normalisation gets wrong)."""
    w = get_workload("transformer")
    batch = w.make_batch(1)
    counts = {int(w.shard_batch(batch, r, 2)["mask"].sum()) for r in range(2)}
    assert len(counts) == 2


def test_split_batch_keeps_non_tensors_and_refuses_uneven_sizes():
    """dict/tuple batches: tensors split on dim 0, other values kept; 6 rows on 4 ranks is an error."""
    batch = {"x": torch.arange(8).view(4, 2), "tag": "keep", "n": torch.tensor(3)}
    part = split_batch(batch, 1, 2)
    assert part["x"].tolist() == [[4, 5], [6, 7]] and part["tag"] == "keep" and int(part["n"]) == 3
    assert split_batch((torch.arange(4), 5), 0, 2)[1] == 5
    with pytest.raises(ValueError, match="6 rows .* cannot be split evenly across 4 ranks"):
        split_batch(torch.zeros(6, 2), 0, 4)


def test_models_build_and_blocks_are_found():
    """The default parallelize finds the repeated blocks of both models and of nested ModuleLists."""
    assert len(tr._blocks(TinyMLP(depth=3))) == 3
    assert len(tr._blocks(TinyTransformer(layers=2))) == 2
    assert [type(b).__name__ for b in tr._blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))] == ["Linear"]
    with pytest.raises(ValueError, match="unknown workload"):
        get_workload("gpt5")


def test_bit_checksum_sees_one_flipped_bit_and_a_swap():
    """Checksums are over the bits: a one-ulp change or a swap of two elements changes them."""
    x = torch.randn(100)
    y = x.clone()
    y[7] = torch.nextafter(y[7], torch.tensor(10.0))
    z = x.clone()
    z[[3, 4]] = z[[4, 3]]
    assert bit_checksum(x) == bit_checksum(x.clone())
    assert len({bit_checksum(x), bit_checksum(y), bit_checksum(z)}) == 3
    assert bit_checksum(torch.ones(3, dtype=torch.bfloat16)) != bit_checksum(torch.ones(3, dtype=torch.float16))


def test_hook_errors_name_the_hook():
    """A hook that raises or returns the wrong type becomes a HookError naming it."""
    hooks = tr.Hooks(
        source="t", build_model=lambda: {"not": "a module"}, make_batch=lambda step: [1, 2],
        loss_fn=tr.default_loss, parallelize=tr.default_parallelize, shard_batch=split_batch,
        build_optimizer=lambda p: torch.optim.SGD(p, lr=0.1), defaults=["shard_batch"],
    )
    with pytest.raises(tr.HookError, match="build_model returned dict, expected a torch.nn.Module"):
        hooks.model(lambda: None)
    with pytest.raises(tr.HookError, match=r"make_batch\(1\) returned list"):
        hooks.batch(1)
    with pytest.raises(tr.HookError, match="hook build_model raised ZeroDivisionError"):
        tr.call_hook("build_model", lambda: 1 / 0)
    with pytest.raises(tr.HookError, match="6 samples .* 4 ranks cannot split"):
        hooks.shard(torch.zeros(6, 2), 0, 4)
