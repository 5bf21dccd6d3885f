"""loss_parity's module-by-module localiser on real tensors and real modules (one process, no collective).

The shape of a difference (localise_shape), the capture and per-module comparison with its
reruns (localise.Capture, compare_calls), and how the records read across ranks
(localise_read): a mechanism at high confidence only where a rerun confirmed it.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distdiag.probes.numerics.localise import Capture, compare_calls, module_state, state_diffs
from distdiag.probes.numerics.localise_read import read_localised
from distdiag.probes.numerics.localise_shape import difference_shape, rel_err, world_relation
from distdiag.probes.numerics.parity_evidence import ParityEvidence


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_a_factor_of_the_world_size_is_read_as_such():
    want = _x(4, 6)
    shape = difference_shape(want * 2, want, world=2, tol=1e-4)
    assert shape["factor"] == pytest.approx(2.0) and shape["factor_is"] == "the world size"
    assert world_relation(0.25, 4) == "one over the world size" and world_relation(1.5, 2) == ""


def test_dropout_is_read_from_zeros_and_one_scale():
    want = _x(64, 32) + 3.0  # no zeros of its own
    mask = torch.rand(want.shape, generator=torch.Generator().manual_seed(1)) < 0.25
    got = torch.where(mask, torch.zeros_like(want), want / 0.75)
    shape = difference_shape(got, want, world=2, tol=1e-4)
    assert shape["dropout"]["p"] == pytest.approx(0.25, abs=1e-5)
    assert shape["dropout"]["zeroed"] == pytest.approx(float(mask.float().mean()), abs=1e-6)
    assert "factor" not in shape


def test_dtype_order_and_rows():
    want = _x(8, 5)
    assert difference_shape(want.to(torch.bfloat16), want, 2, 1e-4)["dtype"] == ["float32", "bfloat16"]
    flipped = want.flip(0)
    assert difference_shape(flipped, want, 2, 1e-4).get("permuted") is True
    some = want.clone()
    some[3] += 1.0
    shape = difference_shape(some, want, 2, 1e-4)
    assert shape["rows"] == [1, 8] and "permuted" not in shape and "factor" not in shape


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 12)
        self.norm = nn.LayerNorm(12)
        self.down = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(F.gelu(self.up(x))))


def _pair() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = _Net()
    return ref, copy.deepcopy(ref)


def _compare(par: nn.Module, ref: nn.Module, trials: dict | None = None) -> tuple[list[dict], Capture]:
    with torch.no_grad(), Capture(par, record=True, trials=trials) as cap:
        par(_x(5, 6, seed=3))
    return compare_calls(cap.calls, ref, world=2, scale=1.0), cap


def test_identical_models_differ_nowhere():
    ref, par = _pair()
    differing, cap = _compare(par, ref)
    assert differing == [] and len(cap.calls) == 4 and cap.errors == []


def test_an_attribute_is_located_and_confirmed_by_the_reference_value():
    ref, par = _pair()
    par.norm.eps = 0.5
    diffs = state_diffs(module_state(ref), module_state(par))
    assert diffs == {"norm": {"eps": [1e-5, 0.5]}}
    differing, _ = _compare(par, ref, trials={"norm": {"eps": 1e-5}})
    first = differing[0]
    assert first["name"] == "norm"  # the first to finish that differs: not down, not the root
    assert first["with_ref_attrs"]["rel"] <= first["tol"] < first["rel"]
    assert [d["name"] for d in differing] == ["norm", ""]  # down gets norm's output and computes it exactly


def test_a_forward_hook_is_confirmed_by_the_rerun_without_hooks():
    ref, par = _pair()
    par.up.register_forward_hook(lambda m, a, out: out * 3)
    assert state_diffs(module_state(ref), module_state(par)) == {"up": {"forward/backward hooks": [0, 1]}}
    differing, _ = _compare(par, ref)
    first = differing[0]
    assert first["name"] == "up" and first["shape"]["factor"] == pytest.approx(3.0)
    assert first["without_hooks"] <= first["tol"]


def test_the_rng_is_restored_per_module_so_dropout_in_both_is_equal():
    ref, par = _pair()
    for m in (ref, par):
        m.norm.register_forward_hook(lambda mod, a, out: F.dropout(out, 0.3, training=True))
    differing, _ = _compare(par, ref)
    assert differing == []


def test_calls_per_forward_are_counted():
    ref, par = _pair()

    def twice(self: _Net, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(self.norm(F.gelu(self.up(x)))))

    par.forward = twice.__get__(par)  # type: ignore[method-assign]
    with torch.no_grad(), Capture(par, record=False) as cap:
        par(_x(5, 6))
    assert cap.counts["norm"] == 2 and cap.counts["up"] == 1 and cap.calls == []


def _ev(localised: dict, gbad: dict | None = None) -> ParityEvidence:
    return ParityEvidence(step=1, world=2, loss_rel=1e-3, loss_tol=1e-4, mean_loss=1.0, ref_loss=1.0, grad_tol=1e-4,
                          gbad=gbad or {}, pbad={}, rank_sums={}, localised=localised)


def _record(first: dict | None, **extra) -> dict:
    return {"step": 1, "loss": [1.0, 1.0], "compared": 4, "differing": [first] if first else [], "first": first,
            "calls": {}, "state": {}, "grad_hooks": [], "errors": [], **extra}


def _first(**extra) -> dict:
    return {"name": "norm", "rel": 0.05, "tol": 1e-4, "shape": {"rows": [5, 5]}, "dtype": "float32",
            "ref_dtype": "float32", "children_exact": 0, "extra_calls": None, **extra}


def test_a_confirmed_attribute_is_named_with_rank_and_numbers():
    rec = _record(_first(with_ref_attrs={"attrs": {"eps": 1e-5}, "rel": 0.0}), state={"norm": {"eps": [1e-5, 0.1]}})
    diag, lines = read_localised(_ev({0: _record(None), 1: rec}))
    assert diag is not None and diag.cause == "module_attribute_differs" and diag.confidence >= 0.8
    text = "\n".join(lines)
    assert "norm" in diag.mechanism and "rank 1" in diag.mechanism and "eps" in diag.mechanism
    assert "confirmed by rerun" in text and "on rank 0 every module computes the reference's output" in text


def test_a_located_module_without_a_confirming_rerun_is_not_identified():
    diag, lines = read_localised(_ev({0: _record(_first(without_hooks=0.05)), 1: _record(_first())}))
    assert diag is not None and diag.cause == "mechanism_not_identified" and diag.confidence < 0.8
    text = "\n".join(lines)
    assert "norm" in text and "candidates:" in text and "what would decide:" in text


def test_dropout_shape_alone_is_named_below_high_confidence():
    first = _first(shape={"dropout": {"p": 0.1, "zeroed": 0.1}})
    diag, _ = read_localised(_ev({1: _record(first)}))
    assert diag is not None and diag.cause == "dropout_differs" and diag.confidence < 0.8
    hooked = {"norm": {"forward/backward hooks": [0, 1]}}
    diag, _ = read_localised(_ev({1: _record({**first, "without_hooks": 0.0, "raw_vs_out": 0.05})}))
    assert diag is not None and diag.confidence < 0.8  # no hook of its own: a rerun without hooks confirms nothing
    diag, _ = read_localised(_ev({1: _record({**first, "without_hooks": 0.0, "raw_vs_out": 0.05}, state=hooked)}))
    assert diag is not None and diag.cause == "dropout_differs" and diag.confidence >= 0.8
    assert "by a forward hook" in diag.mechanism


def test_reruns_that_do_not_reproduce_the_module_confirm_nothing():
    """A module without a hook of its own whose bare rerun does not give its own output again (state the rerun did
    not restore): its reruns decide nothing, so an attribute 'confirmed' by one is not named."""
    first = _first(with_ref_attrs={"attrs": {"eps": 1e-5}, "rel": 0.0}, without_hooks=0.0, raw_vs_out=0.05)
    diag, _ = read_localised(_ev({1: _record(first, state={"norm": {"eps": [1e-5, 0.1]}})}))
    assert diag is not None and diag.cause == "mechanism_not_identified" and diag.confidence < 0.8


def test_gradient_hooks_need_the_rerun_without_them():
    gbad = {"head.weight": {"name": "head.weight", "rel": 1.0, "factor": 2.0, "resid": 1e-7, "ranks": [0, 1]}}
    hooked = _record(None, grad_hooks=["head.weight"])
    diag, _ = read_localised(_ev({0: hooked, 1: hooked}, gbad))
    assert diag is not None and diag.cause == "grad_hook_alters_gradient" and diag.confidence < 0.8
    rerun = {**hooked, "without_grad_hooks": {"hooked": ["head.weight"], "still_bad": [], "max_rel": 1e-7}}
    diag, lines = read_localised(_ev({0: rerun, 1: rerun}, gbad))
    assert diag is not None and diag.confidence >= 0.8 and "x2 (the world size)" in "\n".join(lines)
    other = {"embed.weight": {**gbad["head.weight"], "name": "embed.weight"}}
    assert read_localised(_ev({0: rerun}, other))[0] is None  # a gradient off without a hook: the hook explains nothing


def test_nothing_located_adds_lines_but_names_nothing():
    diag, lines = read_localised(_ev({0: _record(None), 1: _record(None)}))
    assert diag is None and "each of the 4 modules recorded computes the reference's output" in lines[0]
    assert read_localised(_ev({})) == (None, [])


def test_rel_err_is_infinite_on_non_finite():
    assert rel_err(torch.tensor([float("nan")]), torch.tensor([1.0])) == float("inf")


def test_train_step_is_named_only_when_the_plain_step_matches_and_the_reference_agrees():
    gbad = {"head.weight": {"name": "head.weight", "rel": 0.7, "ranks": [0, 1]}}
    order = ["embed.weight", "head.weight", "norm.weight"]
    clean = _record(None, without_train_step={"still_bad": [], "bad_count": 0, "max_rel": 1e-7})

    def ev(accum_equal, records, bad=gbad):
        e = _ev(records, bad)
        e.order, e.train_step, e.accum_equal = order, True, accum_equal
        return e

    diag, lines = read_localised(ev(True, {0: clean, 1: clean}))
    assert diag is not None and diag.cause == "extra_reduction" and diag.confidence < 0.8
    assert "confirmed by rerun" in "\n".join(lines) and "head.weight" in diag.mechanism
    # the reference's own train_step differs from a loss_fn backward (accumulation, clipping): train_step located, not named
    diag, lines = read_localised(ev(False, {0: clean, 1: clean}))
    assert diag is None and any("train_step is what differs" in line for line in lines)
    # every tensor off: not a reduction of some tensors
    diag, _ = read_localised(ev(True, {0: clean}, {n: {**gbad["head.weight"], "name": n} for n in order}))
    assert diag is None
    still = _record(None, without_train_step={"still_bad": ["head.weight"], "bad_count": 1, "max_rel": 0.7})
    assert read_localised(ev(True, {0: clean, 1: still}))[0] is None


def test_reruns_inside_a_parent_do_not_count_as_calls():
    """The root is rerun inside its own hook (no hooks, then the reference's attributes): its children's calls in
    those reruns are not calls of the forward."""
    ref, par = _pair()
    par.eps_like = 1.0  # an attribute that differs, so the root is rerun twice
    with torch.no_grad(), Capture(par, record=True, trials={"": {"eps_like": 2.0}}) as cap:
        par(_x(5, 6))
    assert cap.counts == {"": 1, "up": 1, "norm": 1, "down": 1}
    assert [c.name for c in cap.calls] == ["up", "norm", "down", ""] and cap.calls[-1].trial is not None


def test_a_child_called_twice_is_confirmed_by_the_parent_rerun_with_it_applied_twice():
    from distdiag.probes.numerics.localise import _repeat_trial

    class Mid(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mid = nn.Linear(6, 6)
            self.out = nn.Linear(6, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.mid(x))

    torch.manual_seed(0)
    ref = Mid()
    par = copy.deepcopy(ref)
    par.forward = (lambda x: par.out(par.mid(par.mid(x))))  # type: ignore[method-assign]
    with torch.no_grad(), Capture(par, record=True) as cap:
        par(_x(5, 6))
    with torch.no_grad(), Capture(ref, record=False) as ref_cap:
        ref(_x(5, 6))
    differing = compare_calls(cap.calls, ref, world=2, scale=1.0)
    assert [d["name"] for d in differing] == [""]  # mid and out each compute the reference's output from their inputs
    calls = {n: [c, ref_cap.counts[n]] for n, c in cap.counts.items() if c != ref_cap.counts[n]}
    assert calls == {"mid": [2, 1]}
    trial = _repeat_trial(ref, "", calls, cap.calls, 2, 1.0)
    assert trial is not None and trial["module"] == "mid" and trial["rel"] <= 1e-6
    assert "forward" not in vars(ref.mid)  # the reference's module put back


def test_an_attribute_is_confirmed_in_the_reference_where_the_rank_cannot_rerun():
    """A module the rank does not rerun (FSDP2's sharded ones): the reference's module with the rank's attribute
    values reproduces the rank's output, and the attribute is named, with every rank where it differs."""
    ref, par = _pair()
    par.norm.eps = 0.5
    with torch.no_grad(), Capture(par, record=True) as cap:
        par(_x(5, 6, seed=3))
    first = compare_calls(cap.calls, ref, world=2, scale=1.0, rank_attrs={"norm": {"eps": 0.5}})[0]
    assert first["name"] == "norm" and "with_ref_attrs" not in first
    assert first["ref_with_rank_attrs"] == {"attrs": {"eps": 0.5}, "rel": pytest.approx(0.0, abs=1e-6)}
    first |= {"children_exact": 0, "extra_calls": None}  # what the rank's record adds after the comparison
    state = {"norm": {"eps": [1e-5, 0.5]}}
    diag, lines = read_localised(_ev({0: _record(first, state=state), 1: _record(first, state=state)}))
    assert diag is not None and diag.cause == "module_attribute_differs" and diag.confidence >= 0.8
    assert "ranks 0-1" in diag.mechanism and "norm.eps: 0.5 on ranks 0-1, 1e-05 in the reference" in "\n".join(lines)


def test_a_patched_forward_is_confirmed_by_the_reference_running_it():
    ref, par = _pair()

    def doubled(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps) * 2

    par.norm.forward = types.MethodType(doubled, par.norm)  # type: ignore[method-assign]
    differing, _ = _compare(par, ref)
    first = differing[0]
    assert first["name"] == "norm" and first["ref_with_rank_forward"]["rel"] <= first["tol"]
    assert "doubled" in first["ref_with_rank_forward"]["forward"] and "forward" not in vars(ref.norm)  # put back
    first |= {"children_exact": 0, "extra_calls": None}
    diag, _ = read_localised(_ev({0: _record(None), 1: _record(first)}))
    assert diag is not None and diag.cause == "module_forward_differs" and diag.confidence >= 0.8
    assert "rank 1" in diag.mechanism and "doubled" in diag.mechanism
    ref.norm.forward = types.MethodType(doubled, ref.norm)  # type: ignore[method-assign]
    assert _compare(par, ref)[0] == []  # the same patched forward on both: nothing differs


def test_a_patched_forward_that_may_communicate_is_never_rerun():
    """The rerun runs on one rank: a forward that names a collective, or closes over a module (the parallel model,
    whose sharded parameters gather), would wait there for peers that never come."""
    import torch.distributed as dist

    from distdiag.probes.numerics.localise import _may_communicate

    def summed(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        dist.all_reduce(out)
        return out

    def nested(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        def inner(t: torch.Tensor) -> torch.Tensor:
            return t.full_tensor()
        return inner(x)

    ref, par = _pair()
    held = par

    def closing(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return held.norm.weight * x

    def plain(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps) * 2

    assert _may_communicate(summed) and _may_communicate(nested) and _may_communicate(closing)
    assert not _may_communicate(plain)
    par.norm.forward = types.MethodType(closing, par.norm)  # type: ignore[method-assign]
    differing, _ = _compare(par, ref)
    assert differing and all("ref_with_rank_forward" not in d for d in differing)


def test_an_autocast_region_is_confirmed_by_the_reference_under_autocast():
    ref, par = _pair()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), Capture(par, record=True) as cap:
        par(_x(5, 6, seed=3))
    first = compare_calls(cap.calls, ref, world=2, scale=1.0)[0]
    assert first["name"] == "up" and first["shape"]["dtype"] == ["float32", "bfloat16"]
    assert first["ref_under_autocast"]["dtype"] == "bfloat16" and first["ref_under_autocast"]["rel"] <= 0.1 * first["rel"]
    first |= {"children_exact": 0, "extra_calls": None}
    diag, _ = read_localised(_ev({0: _record(None), 1: _record(first)}))
    assert diag is not None and diag.cause == "compute_precision_lower" and diag.confidence >= 0.8
    assert "torch.autocast(bfloat16) on rank 1" in diag.mechanism and "autocast" in diag.fix
