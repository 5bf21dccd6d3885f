"""loss_parity's module-by-module records (localise.py), read across ranks into a diagnosis and evidence lines.

A mechanism is named at high confidence only when a rerun confirmed it: the module computes
the reference's output without its forward hooks, or with the reference's attribute values,
or the reference's module reproduces the rank's output with one piece of the rank's: its
attribute values, its parameter dtype, an autocast region of its output dtype, its patched
forward; or the reference's parent module with a child applied as often as the rank calls it
does. What is only observed (a dropout-shaped difference, an attribute, a dtype, a call
count) is named below 0.8; a located module with nothing that explains it is "mechanism not
identified", with the module, rank, step and numbers, the candidates left and the rerun that
would decide.
"""

from __future__ import annotations

from typing import Any

from distdiag.probes.causes import ProbeCause
from distdiag.probes.numerics.localise_shape import world_relation
from distdiag.probes.numerics.parity_evidence import Diagnosis, ParityEvidence
from distdiag.report.render import format_ranks

__all__ = ["read_localised"]

CONFIRMED = 0.9
OBSERVED = 0.7


def _name(n: str) -> str:
    return n or "(root)"


def _shape_text(first: dict[str, Any]) -> str:
    """The readings of the difference in words."""
    s = first["shape"]
    parts = []
    if "dtype" in s:
        parts.append(f"its output is {s['dtype'][1]} where the reference's is {s['dtype'][0]}")
    if "factor" in s:
        parts.append(f"its output is the reference's x{s['factor']:.6g}" + (f" ({s['factor_is']})" if s.get("factor_is") else ""))
    if "dropout" in s:
        d = s["dropout"]
        parts.append(f"{d['zeroed']:.1%} of its output elements are zero where the reference's are not and every other one "
                     f"is the reference's x{1 / (1 - d['p']):.4g}: what dropout with p = {d['p']:.3g} does")
    if s.get("permuted"):
        parts.append("its output holds the reference's values in another order")
    if "rows" in s:
        parts.append(f"{s['rows'][0]} of {s['rows'][1]} rows (dim 0) differ")
    if s.get("non_finite"):
        parts.append("non-finite values")
    return "; ".join(parts) or "no simple shape (not a factor, a dtype, dropout or an order)"


def _confirmations(first: dict[str, Any], state: dict[str, Any]) -> dict[str, str]:
    """Each rerun that confirmed a piece, in words (key: hooks, attrs, dtype, repeat). None counts when the module,
    without a hook of its own, did not give its own output again when rerun on the same inputs, RNG and buffers: its
    reruns are not faithful (state they do not restore), so they decide nothing."""
    tol = first["tol"]
    hooked = "forward/backward hooks" in state
    if not hooked and first.get("raw_vs_out") is not None and first["raw_vs_out"] > tol:
        return {}
    out = {}
    if hooked and first.get("without_hooks") is not None and first["without_hooks"] <= tol:
        out["hooks"] = (f"rerun without its forward hooks on the same inputs, {_name(first['name'])} computes the reference's "
                        f"output (rel err {first['without_hooks']:.1e})")
    trial, back = first.get("with_ref_attrs"), first.get("ref_with_rank_attrs")
    if trial and trial["rel"] <= tol:
        shown = ", ".join(f"{k}={v!r}" for k, v in trial["attrs"].items())
        out["attrs"] = f"rerun with the reference's {shown}, {_name(first['name'])} computes the reference's output (rel err {trial['rel']:.1e})"
    elif back and back["rel"] <= tol:
        shown = ", ".join(f"{k}={v!r}" for k, v in back["attrs"].items())
        out["attrs"] = (f"the reference's {_name(first['name'])} rerun with the rank's {shown} reproduces the rank's output "
                        f"(rel err {back['rel']:.1e})")
    low = first.get("ref_in_rank_dtype")
    if low is not None and low <= 0.1 * first["rel"]:
        out["dtype"] = (f"the reference's {_name(first['name'])} computing in {first['dtype']} reproduces the rank's output (rel err "
                        f"{low:.1e}, against {first['rel']:.2e} from the {first['ref_dtype']} reference)")
    auto = first.get("ref_under_autocast")
    if auto and auto["rel"] <= 0.1 * first["rel"]:
        out["autocast"] = (f"the reference's {_name(first['name'])} run under torch.autocast({auto['dtype']}) reproduces the rank's "
                           f"output (rel err {auto['rel']:.1e}, against {first['rel']:.2e} from the reference without it)")
    fwd = first.get("ref_with_rank_forward")
    if fwd and fwd["rel"] <= tol:
        out["forward"] = (f"the reference's {_name(first['name'])} running the rank's forward ({fwd['forward']}, where the reference "
                          f"runs {fwd['reference']}) reproduces the rank's output (rel err {fwd['rel']:.1e})")
    rep = first.get("extra_calls")
    if rep and rep.get("rel") is not None and rep["rel"] <= tol:
        out["repeat"] = (f"the reference's {_name(first['name'])} with {rep['module']} applied {rep['calls'][0]} times in a row "
                         f"reproduces the rank's output (rel err {rep['rel']:.1e})")
    return out


_BITS = {"float64": 64, "float32": 32, "tfloat32": 19, "float16": 16, "bfloat16": 16, "float8_e4m3fn": 8, "float8_e5m2": 8}


def _lower(dtype: str, than: str) -> bool:
    """Whether floating dtype `dtype` (as torch prints it, with or without 'torch.') is less precise than `than`."""
    a, b = _BITS.get(str(dtype).removeprefix("torch.")), _BITS.get(str(than).removeprefix("torch."))
    return a is not None and b is not None and a < b


def _by_ranks(records: dict[int, dict[str, Any]], part: Any) -> dict[tuple[str, str], list[int]]:
    """Each (what, value) that `part(record)` ({what: value}) gives, with the ranks that give it, in first-seen order."""
    out: dict[tuple[str, str], list[int]] = {}
    for r in sorted(records):
        for k, v in (part(records[r]) or {}).items():
            out.setdefault((k, repr(v)), []).append(r)
    return out


def _state_text(records: dict[int, dict[str, Any]], module: str) -> list[str]:
    """What differs in the module's state from the reference's, with every rank where it differs so."""
    diffs = _by_ranks(records, lambda rec: rec.get("state", {}).get(module, {}))
    return [f"{_name(module)}.{k}: {v[1]!r} on {format_ranks(ranks)}, {v[0]!r} in the reference"
            for (k, _), ranks in diffs.items() for v in [records[ranks[0]]["state"][module][k]]]


def _calls_text(records: dict[int, dict[str, Any]]) -> list[str]:
    """Modules called another number of times per forward than in the reference, with the ranks where they are."""
    found = _by_ranks(records, lambda rec: rec.get("calls", {}))
    return [f"calls per forward: {_name(n)} {c[0]} on {format_ranks(ranks)}, {c[1]} in the reference"
            for (n, _), ranks in found.items() for c in [records[ranks[0]]["calls"][n]]]


def _decide(first: dict[str, Any], rec: dict[str, Any], rank: int, ranks: str) -> tuple[ProbeCause, str, float]:
    """(cause, mechanism, confidence) from the confirmations and observations of the first differing module."""
    name, state = _name(first["name"]), rec.get("state", {}).get(first["name"], {})
    ok = _confirmations(first, state)
    if "dropout" in first["shape"]:
        how = " by a forward hook" if "hooks" in ok else " by its own settings" if "attrs" in ok else ""
        return ProbeCause.DROPOUT_DIFFERS, f"{name}'s output is dropped out{how} on {ranks}, not in the reference", \
            CONFIRMED if ok.keys() & {"hooks", "attrs"} else OBSERVED
    if "attrs" in ok:
        trial = first.get("with_ref_attrs") or first.get("ref_with_rank_attrs") or {"attrs": {}}
        shown = ", ".join(f"{k} {v[1]!r} (reference {v[0]!r})" for k, v in state.items() if k in trial["attrs"])
        return ProbeCause.MODULE_ATTRIBUTE_DIFFERS, f"{name} is configured differently on {ranks}: {shown}", CONFIRMED
    if "hooks" in ok:
        return ProbeCause.FORWARD_HOOK_ALTERS_OUTPUT, f"a forward hook on {name} changes its output on {ranks}", CONFIRMED
    if "dtype" in ok:
        return (ProbeCause.COMPUTE_PRECISION_LOWER, f"{name} computes in {first['dtype']} on {ranks} ({first['ref_dtype']} in the "
                "reference)", CONFIRMED)
    if "autocast" in ok:
        return (ProbeCause.COMPUTE_PRECISION_LOWER, f"{name} computes under torch.autocast({first['ref_under_autocast']['dtype']}) on "
                f"{ranks} ({first['ref_dtype']} in the reference)", CONFIRMED)
    if "repeat" in ok:
        rep = first["extra_calls"]
        return (ProbeCause.MODULE_CALLED_EXTRA, f"{rep['module']} runs {rep['calls'][0]} times per forward on {ranks} "
                f"({rep['calls'][1]} in the reference)", CONFIRMED)
    if "forward" in ok:
        fwd = first["ref_with_rank_forward"]
        return (ProbeCause.MODULE_FORWARD_DIFFERS, f"{name} runs another forward on {ranks}: {fwd['forward']} (the reference's runs "
                f"{fwd['reference']})", CONFIRMED)
    if first.get("dtype") and first.get("ref_dtype") and first["dtype"] != first["ref_dtype"]:
        return ProbeCause.COMPUTE_PRECISION_LOWER, f"{name} computes in {first['dtype']} on {ranks}", OBSERVED - 0.1
    out = first["shape"].get("dtype")
    if out and _lower(out[1], out[0]):
        # parameters of one dtype (above), the same inputs, a lower-precision output: a cast or an
        # autocast region around the module on that rank only
        return (ProbeCause.COMPUTE_PRECISION_LOWER, f"{name} outputs {out[1]} on {ranks} where the reference's outputs {out[0]} "
                "from the same inputs and parameters of one dtype (an autocast region or a cast covers it there)",
                OBSERVED - 0.1)
    return ProbeCause.MECHANISM_NOT_IDENTIFIED, f"mechanism not identified: {name} computes differently on {ranks}", 0.4


def _located(records: dict[int, dict[str, Any]], ev: ParityEvidence) -> Diagnosis:
    ranks_on = sorted(r for r, rec in records.items() if rec.get("first"))
    rank = ranks_on[0]
    rec, first = records[rank], records[rank]["first"]
    where = format_ranks(ranks_on)
    cause, mechanism, confidence = _decide(first, rec, rank, where)
    others = [d["name"] for d in rec["differing"][1:]]
    lines = [
        f"module by module at step {rec['step']} (each module of the parallel model against the reference's module of the "
        f"same name run on the same inputs and RNG state): the first to differ is {_name(first['name'])} on {where} "
        f"(rel err {first['rel']:.3g}, tolerance {first['tol']:.0e}; {first['children_exact']} module(s) inside it exact)",
        f"  shape: {_shape_text(first)}",
        *(f"  state: {s}" for s in _state_text(records, first["name"])),
        *(f"  {s}" for s in _calls_text(records)),
        *(f"  confirmed by rerun: {t}" for t in _confirmations(first, rec.get("state", {}).get(first["name"], {})).values()),
    ]
    exact = sorted(r for r, x in records.items() if not x.get("first") and not x.get("error"))
    if exact:
        lines.append(f"  on {format_ranks(exact)} every module computes the reference's output from the same inputs")
    if others:
        lines.append(f"  modules after it that also differ on their own inputs: {', '.join(_name(n) for n in others[:6])}")
    if confidence < 0.8:
        lines += _undecided(first, rec)
    fix = _fix(cause, first, where)
    return Diagnosis(cause, mechanism, lines, fix, confidence)


def _undecided(first: dict[str, Any], rec: dict[str, Any]) -> list[str]:
    name = _name(first["name"])
    return [
        f"  candidates: {name}'s weights or buffers on that rank, an attribute or flag set on the parallel path, a hook, "
        "its code path (a rank-guarded branch), the dtype it computes in",
        f"  what would decide: rerun {name} on that rank with the reference's weights and settings copied in, and print its "
        "forward hooks and attributes on each rank",
    ]


def _fix(cause: ProbeCause, first: dict[str, Any], where: str) -> str:
    name = _name(first["name"])
    return {
        ProbeCause.DROPOUT_DIFFERS: f"remove the dropout applied to {name} on {where} (or apply the same on every rank and in the "
                           "reference, and switch it off for the check)",
        ProbeCause.MODULE_ATTRIBUTE_DIFFERS: f"set {name}'s attributes the same on every rank and in the single-process setup "
                                    "(read them from one config, not per node)",
        ProbeCause.FORWARD_HOOK_ALTERS_OUTPUT: f"remove the forward hook on {name} that parallelize (or code on the parallel path) "
                                      "registers, or register it in the reference too",
        ProbeCause.COMPUTE_PRECISION_LOWER: f"compute {name} in the parameters' dtype (check the mixed-precision policy given to "
                                   "fully_shard for it, and any torch.autocast region that covers it on that rank)",
        ProbeCause.MODULE_CALLED_EXTRA: f"call each submodule of {name} once per forward on every rank (a rank-guarded or patched "
                               "forward calls one twice)",
        ProbeCause.MODULE_FORWARD_DIFFERS: f"run {name}'s own forward on every rank: remove the forward that code on the parallel "
                                  f"path sets on {where} (a patched or fallback forward), or fix it to compute what the "
                                  "reference's does",
    }.get(cause, f"compare {name} between the reference and {where}: weights, buffers, attributes, hooks and the code "
                 "path it takes there")


def _no_module(records: dict[int, dict[str, Any]], ev: ParityEvidence) -> tuple[Diagnosis | None, list[str]]:
    """Every module computes the reference's output on every rank: what that rules out, and gradient hooks."""
    done = {r: rec for r, rec in records.items() if not rec.get("error") and rec.get("compared")}
    if not done:
        return None, []
    rank = min(done)
    rec = done[rank]
    losses = rec.get("loss") or [None, None]
    lines = [f"module by module at step {rec['step']}: each of the {rec['compared']} modules recorded computes the "
             f"reference's output from the same inputs on {format_ranks(sorted(done))}"
             + (f" (rank {rank}'s shard: loss {losses[0]:.6g} on the parallel model, {losses[1]:.6g} on the reference model)"
                if None not in losses else "")]
    extra = {r: x["calls"] for r, x in done.items() if x.get("calls")}
    lines += [f"  calls per forward: {_name(n)} {c[0]} on rank {r}, {c[1]} in the reference"
              for r, calls in sorted(extra.items()) for n, c in calls.items()]
    found = _grad_hooks(done, ev, lines) or _extra_calls(extra, ev, lines) or _train_step(done, ev, lines)
    return found, found.evidence if found else lines


def _grad_hooks(done: dict[int, dict[str, Any]], ev: ParityEvidence, lines: list[str]) -> Diagnosis | None:
    """Every gradient over tolerance carries a gradient hook the reference's parameter has not: the hook, confirmed
    when the step rerun without the hooks brings those gradients back to the reference's."""
    hooked = {r: set(x.get("grad_hooks", [])) for r, x in done.items() if x.get("grad_hooks")}
    if not hooked or not ev.gbad or not set(ev.gbad) <= set().union(*hooked.values()):
        return None
    names = sorted(set().union(*hooked.values()))
    factors = {n: float(b["factor"]) for n, b in ev.gbad.items() if b.get("resid", 1.0) < 1e-3 and b.get("factor")}
    shown = ", ".join(f"{n} x{f:.6g}" + (f" ({rel})" if (rel := world_relation(f, ev.world)) else "") for n, f in factors.items())
    lines = [*lines, f"  every gradient over tolerance carries a gradient hook the reference's parameter has not "
             f"({', '.join(names)} on {format_ranks(sorted(hooked))})" + (f"; off by one factor: {shown}" if shown else "")]
    reruns = [x["without_grad_hooks"] for x in done.values() if x.get("without_grad_hooks")]
    confirmed = bool(reruns) and all(not r["still_bad"] for r in reruns)
    if confirmed:
        worst = max(r["max_rel"] for r in reruns)
        lines.append(f"  confirmed by rerun: step {ev.step} again with those hooks removed, {', '.join(names)} match the "
                     f"reference's gradients (rel err {worst:.1e})")
    else:
        lines.append("  what would decide: rerun the step with those hooks removed"
                     + (f" (done: {', '.join(sorted({n for r in reruns for n in r['still_bad']}))} still differ)" if reruns else ""))
    return Diagnosis(ProbeCause.GRAD_HOOK_ALTERS_GRADIENT, f"a gradient hook on {', '.join(names)} alters its gradient on the "
                     "parallel model", lines, f"remove the gradient hook registered on {', '.join(names)} on the parallel "
                     "path (FSDP2 and DDP already average gradients over ranks)", CONFIRMED if confirmed else OBSERVED - 0.1)


def _extra_calls(extra: dict[int, dict[str, list[int]]], ev: ParityEvidence, lines: list[str]) -> Diagnosis | None:
    """No module computes differently, but one runs more often per forward than in the reference, and the only
    gradients over tolerance are inside it."""
    more = {n for calls in extra.values() for n, c in calls.items() if c[0] > c[1] > 0}
    if not more or not ev.gbad or not all(any(g.startswith(n + ".") for n in more) for g in ev.gbad):
        return None
    ranks = format_ranks(sorted(r for r, calls in extra.items() if more & set(calls)))
    shown = ", ".join(sorted(more))
    return Diagnosis(ProbeCause.MODULE_CALLED_EXTRA, f"{shown} runs more often per forward on {ranks} than in the reference", [
        *lines, f"  every gradient over tolerance is a parameter of {shown}; every module computes the reference's output "
        "from its inputs, so the extra call, not the module, is what differs",
        "  what would decide for certain: rerun the forward on that rank with the module called once"],
        f"call {shown} once per forward on every rank (a rank-guarded or patched forward calls it again)", OBSERVED)


def _train_step(done: dict[int, dict[str, Any]], ev: ParityEvidence, lines: list[str]) -> Diagnosis | None:
    """The step rerun as one loss_fn backward and optimizer.step on both models matches: train_step is the piece.
    Named (below 0.8) only where it acts on the parallel path alone (in the reference process it gives one loss_fn
    backward's gradients) and on some tensors only: a reduction or rescaling of those tensors outside parallelize."""
    reruns = [x.get("without_train_step") for x in done.values()]
    if not ev.gbad or not reruns or not all(r is not None and r["bad_count"] == 0 for r in reruns):
        return None
    worst = max(r["max_rel"] for r in reruns if r)
    lines.append(f"  confirmed by rerun: step {ev.step} again as one loss_fn backward and optimizer.step on both models, "
                 f"every gradient matches the reference's (rel err {worst:.1e}): train_step is what differs")
    names = sorted(ev.gbad)
    if not ev.accum_equal or len(names) >= len(set(ev.order)):
        return None
    shown = ", ".join(names[:6]) + (f" (+{len(names) - 6})" if len(names) > 6 else "")
    return Diagnosis(ProbeCause.EXTRA_REDUCTION, f"train_step changes the gradients of {shown} on the parallel model only", [
        *lines, f"  in the reference process train_step gives one loss_fn backward's gradients, and only {len(names)} of "
        f"{len(set(ev.order))} tensors differ: train_step does something to them in the parallel run alone",
        "  candidates: a reduction of those gradients on top of the one parallelize sets up (an all_reduce of a DTensor's "
        "local shard, a tied weight synced by hand), or a rescaling that reads the world size",
        f"  what would decide: print {names[0]}'s gradient in train_step before and after its handling, on each rank"],
        f"remove train_step's own handling of {shown}: FSDP2 (or DDP) already reduces these gradients", OBSERVED)


def read_localised(ev: ParityEvidence) -> tuple[Diagnosis | None, list[str]]:
    """The diagnosis the module-by-module records support (None: they name nothing) and the evidence lines to add."""
    records = {r: rec for r, rec in ev.localised.items() if rec}
    if not records:
        return None, []
    if any(rec.get("first") for rec in records.values()):
        diag = _located(records, ev)
        return diag, diag.evidence
    return _no_module(records, ev)
