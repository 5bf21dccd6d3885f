"""Rules added for bugs the first rules were not written for (tests/corpus/gen_targets), on evidence built in
one process: a tensor that differs in a few rows, modules in eval mode on one rank, requires_grad per rank,
epochs of different lengths, buffers a checkpoint does not hold, accumulation off by an exact 1/k."""

from __future__ import annotations

import torch
from torch import nn

from distdiag.probes.checkpoint.findings import unsaved_findings
from distdiag.probes.checkpoint.probe import _unsaved_changing
from distdiag.probes.data.probe import _uneven_length, batch_count
from distdiag.probes.numerics.parity_report import _accumulation_findings
from distdiag.probes.numerics.setup_digest import classify, digest_model
from distdiag.probes.numerics.setup_findings import eval_modules, layout_findings, mode_findings


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 4), nn.Dropout(0.1))


def test_one_row_differing_is_a_partial_write_not_a_load():
    """Rank 0's pad row zeroed: a few sampled elements differ, not the whole tensor as a load would."""
    a, b = _model(), _model()
    with torch.no_grad():
        a[0].weight[31].zero_()
    digests = {0: digest_model(a), 1: digest_model(b)}
    div = classify(digests, ["0.weight"])
    assert div.cause == "setup_divergence_partial_tensor" and div.confidence < 0.8 and "padding_idx" in div.reason
    with torch.no_grad():
        a[0].weight.normal_()  # the whole tensor rewritten: a load, not a row
    assert classify({0: digest_model(a), 1: digest_model(b)}, ["0.weight"]).cause != "setup_divergence_partial_tensor"


def test_requires_grad_set_on_one_rank_only():
    a, b = _model(), _model()
    b[1].weight.requires_grad_(False)
    findings, _, skipped = layout_findings({0: digest_model(a), 1: digest_model(b)})
    (f,) = findings
    assert f.cause == "requires_grad_differs_across_ranks" and "1.weight" in f.issue and "1.weight" not in skipped


def test_eval_mode_on_one_rank_is_named_and_a_common_eval_module_is_not():
    a, b = _model(), _model()
    a.eval()
    (f,) = mode_findings({0: {"eval_modules": eval_modules(a)}, 1: {"eval_modules": eval_modules(b)}})
    assert f.cause == "training_mode_differs_across_ranks" and f.ranks == [0] and "model.train()" in f.fix
    a.train()
    a[2].eval()
    b[2].eval()  # a frozen module in eval on every rank, by design
    assert mode_findings({0: {"eval_modules": eval_modules(a)}, 1: {"eval_modules": eval_modules(b)}}) == []


def test_epochs_of_different_lengths():
    (f,) = _uneven_length({0: 17, 1: 8})
    assert f.cause == "batch_count_differs" and f.ranks == [1] and "8" in f.issue
    assert _uneven_length({0: 12, 1: 12}) == [] and _uneven_length({0: None, 1: 3}) == []
    assert batch_count(iter([1, 2])) is None and batch_count([1, 2, 3]) == 3


def test_a_non_persistent_buffer_that_training_changes_is_not_saved():
    class Net(nn.Module):
        def __init__(self, persistent: bool) -> None:
            super().__init__()
            self.register_buffer("steps", torch.zeros(()), persistent=persistent)
            self.register_buffer("table", torch.arange(4.0), persistent=False)  # a cache that never changes

        def forward(self) -> None:
            self.steps += 1

    model = Net(persistent=False)
    assert _unsaved_changing(model, model) == ["steps"]
    saved = Net(persistent=True)
    assert _unsaved_changing(saved, saved) == []
    (f,) = unsaved_findings({0: {"unsaved": ["steps"]}, 1: {"unsaved": ["steps"]}})
    assert f.cause == "buffer_not_saved" and f.severity == "warning" and "persistent=True" in f.fix


def _accum(factor: float) -> dict:
    return {"equal": False, "max_rel": 0.5, "bad": [], "factor": factor, "scaled_resid": 1e-8,
            "plain_norm": 2.0, "stepped_norm": 2.0 * factor}


def test_accumulation_exactly_one_over_k_is_not_clipping():
    (f,) = _accumulation_findings(_accum(0.5), bad=False)
    assert f.cause == "grad_accumulation_scaled" and f.severity == "warning" and "without dividing by 2" in f.fix
    (g,) = _accumulation_findings(_accum(0.4137), bad=False)  # max_norm / norm: clipping, an info
    assert g.severity == "info" and "clips" in g.issue


def test_a_train_step_that_advances_module_state_itself_is_not_read_as_accumulation():
    """A counter train_step advances (loss_fn's forward only reads it): one loss_fn backward and train_step did not
    start from the same state, so their gradients differing says nothing about accumulation: an info, not a
    grad_accumulation_means warning. Buffers a loss_fn forward updates too (running statistics) do not count."""
    from distdiag.probes.numerics.loss_parity import _buffer_values, _changed_by_step, _restore_buffers
    from distdiag.probes.numerics.parity_report import _accum_equal

    m = nn.Module()
    m.register_buffer("steps", torch.zeros(()))
    m.register_buffer("running", torch.zeros(2))
    before = _buffer_values(m)
    m.running += 1  # one loss_fn forward updates running statistics
    after_loss = _buffer_values(m)
    m.running += 1  # train_step's forward, and the counter it advances itself
    m.steps += 1
    assert _changed_by_step(before, after_loss, _buffer_values(m)) == ["steps"]
    assert _changed_by_step(before, None, _buffer_values(m)) == []
    _restore_buffers(m, before)  # the check's own backward must not advance the reference past the parallel run
    assert float(m.steps) == 0 and m.running.tolist() == [0.0, 0.0]
    accum = {**_accum(0.4137), "equal": False, "max_rel": 0.6, "scaled_resid": 0.5, "state_changed": ["layers.1.steps"]}
    (f,) = _accumulation_findings(accum, bad=True)
    assert f.severity == "info" and "layers.1.steps" in f.issue and not f.cause
    assert _accum_equal(accum) is None and _accum_equal({**accum, "state_changed": []}) is False
