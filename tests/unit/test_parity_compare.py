"""loss_parity's tensor comparison: a reference tensor that is zero (to within the tolerance) is
judged on the absolute scale of the whole reference, not relative to its own norm."""

from __future__ import annotations

import torch

from distdiag.probes.numerics.loss_parity import compare_tensors, reference_rms


def _grads(bias: torch.Tensor) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"proj.weight": torch.randn(8, 8, generator=gen) * 0.1, "proj.bias": bias,
            "head.weight": torch.randn(4, 8, generator=gen) * 0.1}


def test_rounding_noise_on_an_exactly_zero_reference_is_within_tolerance():
    """A bias before a BatchNorm: the reference's gradient exactly zero, the ranks' rounding noise (1e-9)."""
    ref = _grads(torch.zeros(8))
    par = {**ref, "proj.bias": torch.full((8,), 1.6e-9)}
    cmp = compare_tensors(ref, par, 1.0)
    assert cmp["bad"] == [] and cmp["max_rel"] < 1e-6


def test_rounding_noise_on_both_sides_of_a_near_zero_reference_is_within_tolerance():
    """The same bias whose reference gradient is itself rounding noise (5e-9), of another sign on the ranks."""
    ref = _grads(torch.full((8,), 5e-9))
    par = {**ref, "proj.bias": torch.full((8,), -1e-8)}
    assert compare_tensors(ref, par, 1.0)["bad"] == []


def test_a_model_sized_value_where_the_reference_is_zero_is_still_an_error():
    """The bug side: the ranks give that bias a gradient of the model's own size: over tolerance."""
    ref = _grads(torch.zeros(8))
    par = {**ref, "proj.bias": torch.full((8,), 0.05)}
    (bad,) = compare_tensors(ref, par, 1.0)["bad"]
    assert bad["name"] == "proj.bias" and bad["rel"] > 0.1


def test_a_small_but_real_tensor_keeps_its_relative_scale():
    """A reference tensor 1e-3 of the others' size (above the tolerance x RMS) is judged relative to itself: x2 fails."""
    ref = _grads(torch.full((8,), 1e-4))
    assert reference_rms(ref) > 1e-3
    par = {**ref, "proj.bias": torch.full((8,), 2e-4)}
    (bad,) = compare_tensors(ref, par, 1.0)["bad"]
    assert bad["name"] == "proj.bias" and 0.9 < bad["rel"] < 1.1
