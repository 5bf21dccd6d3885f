"""setup_sync's and data_shards' decisions on digests, device rows and row hashes, taken from real
tensors and modules (the process-group runs are in tests/corpus/test_setup_corpus.py)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset

from distdiag.probes.data.fingerprint import identical_groups, overlaps, row_hashes
from distdiag.probes.data.probe import shuffles
from distdiag.probes.numerics.setup_digest import SAMPLE, classify, digest_model, outermost_modules, sample_diff
from distdiag.probes.numerics.setup_findings import divergence_findings, layout_findings
from distdiag.probes.numerics.setup_placement import device_problems


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))


def _digests(*models: nn.Module) -> dict[int, dict]:
    return {r: digest_model(m) for r, m in enumerate(models)}


def test_three_ranks_each_seeded_apart_is_rank_seeded():
    d = _digests(_model(1), _model(2), _model(3))
    findings, compared, skipped = layout_findings(d)
    assert findings == [] and compared == 6 and not skipped
    (f,) = divergence_findings(d, skipped, experts=False)
    assert f.cause == "setup_divergence_rank_seeded" and f.ranks == [0, 1, 2]
    # LayerNorm's ones and zeros agree on every rank: only the random Linear weights differ.
    assert "1.weight" not in f.evidence and "0.weight" in f.evidence


def test_one_rank_of_three_loaded_is_named():
    models = [_model(1) for _ in range(3)]
    with torch.no_grad():
        models[2][2].weight.add_(0.5)
    (f,) = divergence_findings(_digests(*models), set(), experts=False)
    assert f.cause == "setup_divergence_loaded_on_one_rank" and f.ranks == [2]
    assert "max |diff| 0.5" in f.evidence and "8 of 8 elements differ" in f.evidence


def test_two_ranks_decided_by_the_parameters_left_equal():
    a, b = _model(1), _model(1)
    with torch.no_grad():
        b[0].weight.mul_(2)
    div = classify(_digests(a, b), ["0.weight"])
    assert div.cause == "setup_divergence_loaded_on_one_rank" and "at 3 or more ranks" in div.reason
    every = classify(_digests(_model(1), _model(2)), ["0.weight", "0.bias", "2.weight", "2.bias"])
    assert every.cause == "setup_divergence_rank_seeded"


def test_same_values_under_other_names_is_the_init_order():
    """Branches built in another order on one rank: the same values, under swapped names: init order, not a load."""
    def branches(order: list[str]) -> nn.Module:
        torch.manual_seed(0)
        return nn.ModuleDict({n: nn.Linear(4, 4) for n in order})

    a, b = branches(["x", "y", "z"]), branches(["z", "x", "y"])
    b = nn.ModuleDict({n: b[n] for n in ["x", "y", "z"]})  # the same names in the same order, other values
    names = [f"{n}.{p}" for n in "xyz" for p in ("weight", "bias")]
    div = classify(_digests(a, b), names)
    assert div.cause == "setup_divergence_init_order" and "under different names" in div.reason
    c = branches(["x", "y", "z"])
    with torch.no_grad():
        c["x"].weight.mul_(2)  # a new value, not a move: not the order
    assert classify(_digests(a, c), ["x.weight"]).cause != "setup_divergence_init_order"


def test_buffers_only_and_groups_of_two():
    a, b = nn.BatchNorm1d(3), nn.BatchNorm1d(3)
    b.running_mean.fill_(1.0)
    assert classify(_digests(a, b), ["running_mean"]).cause == "setup_divergence_buffer_per_rank"
    m = [_model(1), _model(1), _model(2), _model(2)]
    d = _digests(*m)
    assert classify(d, ["0.weight", "0.bias", "2.weight", "2.bias"]).cause == "setup_divergence"


def test_dtype_difference_is_its_own_finding_and_not_a_value_difference():
    a, b = _model(1), _model(1).half()
    findings, _, skipped = layout_findings(_digests(a, b))
    assert [f.cause for f in findings] == ["dtype_differs_across_ranks"] and "0.weight" in skipped
    assert divergence_findings(_digests(a, b), skipped, experts=False) == []


def test_experts_distinct_by_design_are_not_flagged_but_a_one_rank_load_is():
    models = [_model(1) for _ in range(3)]
    with torch.no_grad():
        for r, m in enumerate(models):
            m[2].weight.fill_(float(r))  # this rank's experts
        models[0][0].weight.add_(1.0)  # a dense layer loaded on rank 0 only
    found = divergence_findings(_digests(*models), set(), experts=True)
    assert [f.cause for f in found] == ["expert_weights_rank_distinct", "setup_divergence_loaded_on_one_rank"]
    assert found[1].ranks == [0] and "2.weight" not in found[1].issue


def test_sample_bounds_large_tensors_and_names_outermost_module():
    big = torch.zeros(10 * SAMPLE)
    other = big.clone()
    other[::2] = 1.0
    a, b = _digests(nn.ParameterList([nn.Parameter(big)]), nn.ParameterList([nn.Parameter(other)])).values()
    worst, ndiff, nsampled = sample_diff(a["0"], b["0"])
    assert nsampled == SAMPLE and worst == 1.0 and 0 < ndiff < SAMPLE
    every = ["enc.a.weight", "enc.b.weight", "dec.weight", "head"]
    assert outermost_modules(["enc.a.weight", "enc.b.weight", "head"], every) == ["enc", "head"]


def test_meta_tensors_are_not_compared():
    with torch.device("meta"):
        m = _model(1)
    d = _digests(m, m)
    findings, compared, skipped = layout_findings(d)
    assert compared == 0 and len(skipped) == 6 and findings == []


def test_device_problems_on_gpu_names():
    rows = [["w", "param", "cuda:0", "float32", True, 100], ["b", "buffer", "cuda:0", "float32", False, 10]]
    assert device_problems(rows, "cuda:0", True) == []
    (cause, where, detail) = device_problems(rows, "cuda:1", True)[0]
    assert cause == "module_on_wrong_device" and where == "the whole model" and "cuda:0" in detail
    mixed = rows + [["head.weight", "param", "cpu", "float32", True, 4]]
    (problem,) = device_problems(mixed, "cuda:0", True)
    assert problem[0] == "module_on_wrong_device" and problem[1] == "head" and "on cpu" in problem[2]
    meta = rows + [["head.weight", "param", "meta", "float32", True, 4]]
    assert device_problems(meta, "cuda:0", True)[0][:2] == ("left_on_meta", "head")
    assert device_problems(meta, "cuda:0", False) == []


def test_row_hashes_find_identical_and_overlapping_ranks():
    x = torch.arange(24.0).reshape(12, 2)
    y = torch.arange(12)
    same = [row_hashes((x[i:i + 4], y[i:i + 4])) for i in (0, 4)]
    shifted = [row_hashes((x[i:i + 4], y[i:i + 4])) for i in (1, 5)]
    apart = [row_hashes({"x": x[i:i + 4], "y": y[i:i + 4]}) for i in (8,)]
    assert identical_groups({0: same, 1: same, 2: shifted}) == [[0, 1]]
    pairs = {(a, b): share for a, b, share, _ in overlaps({0: same, 1: same, 2: shifted, 3: apart}, [[0, 1]])}
    assert (0, 1) not in pairs and pairs[(0, 2)] == 7 / 8 and pairs[(0, 3)] == 0.0
    assert row_hashes(torch.tensor([[True, False]])) and row_hashes({"n": 3}) == []


def test_shuffles_reads_the_loaders_sampler():
    ds = TensorDataset(torch.zeros(8, 1))
    assert shuffles(DataLoader(ds)) is False
    assert shuffles(DataLoader(ds, shuffle=True)) is True
    assert shuffles(DataLoader(ds, sampler=RandomSampler(ds))) is True
    assert shuffles(DataLoader(ds, sampler=DistributedSampler(ds, num_replicas=2, rank=0, shuffle=False))) is False
    assert shuffles(iter([ds[0]])) is None
