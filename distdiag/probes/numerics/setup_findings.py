"""setup_sync's findings on the digests: dtypes or shapes that differ across ranks, and values
that differ (with the mechanism setup_digest.classify names and a fix for it)."""

from __future__ import annotations

from typing import Any

from distdiag.probes.base import alike, group_alike, minority_ranks
from distdiag.probes.causes import ProbeCause
from distdiag.probes.numerics.setup_after import AfterParallel, reach
from distdiag.probes.numerics.setup_digest import TensorDigest, classify, outermost_modules, sample_diff
from distdiag.report.model import Finding
from distdiag.report.render import format_ranks

__all__ = ["layout_findings", "divergence_findings", "mode_findings", "eval_modules", "FIXES"]

FIXES = {
    ProbeCause.SETUP_DIVERGENCE_LOADED_ON_ONE_RANK: (
        "load the weights on every rank before parallelize (each rank reads the checkpoint), or load on rank 0 and "
        "broadcast every parameter and buffer from rank 0 (dist.broadcast(t, src=0) over model.state_dict().values()) "
        "before fully_shard: FSDP2 has no sync_module_states, fully_shard keeps each rank's slice of its own copy, so "
        "the model trained is a mix of loaded and freshly initialised weights. After fully_shard, "
        "set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)) "
        "does the broadcast"
    ),
    ProbeCause.SETUP_DIVERGENCE_RANK_SEEDED: (
        "seed every rank identically before building the model (torch.manual_seed(seed), not seed + rank); seed per "
        "rank only after the model is built (for data order or dropout), or broadcast the parameters from rank 0 "
        "before fully_shard"
    ),
    ProbeCause.SETUP_DIVERGENCE_BUFFER_PER_RANK: (
        "the buffer is computed per rank (rank-dependent init: the rank, a local device, per-rank data or length in its "
        "formula): compute the buffer identically on every rank, in the same dtype, or broadcast it from rank 0 after build: FSDP and DDP never reduce buffers, so the difference "
        "stays for the whole run"
    ),
    ProbeCause.SETUP_DIVERGENCE_INIT_ORDER: (
        "build and initialise the modules in one order on every rank: iterate sorted(names), not a set of names (whose "
        "order follows each process's Python hash seed) or an unsorted directory listing, before the seed is used; "
        "under distdiag check's default fork launch the ranks share one hash seed and such a bug hides, so confirm "
        "with `distdiag check --launch torchrun`"
    ),
    ProbeCause.SETUP_DIVERGENCE_PARTIAL_TENSOR: (
        "build the same tensors on every rank: give every rank the same construction arguments (padding_idx, special "
        "tokens, one config and one tokenizer for all ranks) and the same partial loads, or broadcast the state from "
        "rank 0 before parallelize; fully_shard keeps each rank's slice of its own copy"
    ),
    ProbeCause.SETUP_DIVERGENCE: (
        "make build_model give the same state on every rank (same seed, same checkpoint on every rank), or broadcast "
        "the state from rank 0 before parallelize"
    ),
}


def layout_findings(digests: dict[int, dict[str, TensorDigest]]) -> tuple[list[Finding], int, set[str]]:
    """Tensors whose dtype or shape differs across ranks (no value comparison makes sense for them).

    Returns the findings, how many tensors were compared, and the keys left out of the value
    comparison (held by one rank, on meta, sharded, or of a different dtype/shape).
    """
    ranks = sorted(digests)
    # Each distinct digests object once (ranks that posted them alike hold one: shared_fields).
    classes = alike(ranks, [digests[r] for r in ranks])
    keys = sorted({k for d, _ in classes for k in d})
    skipped: set[str] = set()
    by_what: dict[str, list[tuple[str, dict[Any, list[int]]]]] = {"dtype": [], "shape": [], "trainable": []}
    compared = 0
    for key in keys:
        holding = [(d[key], rs) for d, rs in classes if key in d]
        first = holding[0][0]
        if sum(len(rs) for _, rs in holding) < 2 or first["kind"] == "sharded param" or any("bits" not in e for e, _ in holding):
            skipped.add(key)
            continue
        compared += 1
        for what in ("dtype", "shape"):
            groups = group_alike([(str(e[what]), rs) for e, rs in holding])
            if len(groups) > 1:
                by_what[what].append((key, groups))
                skipped.add(key)
                break
        # requires_grad: the values still compare, but FSDP2 groups and reduces only the trainable ones
        groups = group_alike([(str(e.get("trainable")), rs) for e, rs in holding])
        if first["kind"] == "param" and len(groups) > 1:
            by_what["trainable"].append((key, groups))
    findings = [_layout_finding(what, items) for what, items in by_what.items() if items]
    return findings, compared, skipped


_LAYOUT_CAUSE = {"dtype": ProbeCause.DTYPE_DIFFERS_ACROSS_RANKS, "shape": ProbeCause.SHAPE_DIFFERS_ACROSS_RANKS}


def _layout_finding(what: str, items: list[tuple[str, dict[Any, list[int]]]]) -> Finding:
    names = [k for k, _ in items]
    lines = [f"{k}: " + "; ".join(f"{format_ranks(m)}: {v}" for v, m in g.items()) for k, g in items[:8]]
    odd = sorted({r for _, g in items for r in _minority(g)})
    if what == "trainable":
        lines = [f"{k}: " + "; ".join(f"{format_ranks(m)}: requires_grad {v}" for v, m in g.items()) for k, g in items[:8]]
        return Finding(
            severity="error",
            issue=f"{len(names)} parameter(s) are trainable on some ranks and frozen on others: {_shown(names)}",
            evidence="\n".join(lines) + "\nrequires_grad is set per rank (a freeze flag, a config or a branch that reads "
                     "the rank): FSDP2 shards and reduces only trainable parameters, so the ranks' collectives differ "
                     "in size (a mismatch that aborts or hangs), and a frozen copy never learns",
            ranks=odd, fix="freeze the same parameters on every rank, before parallelize (one config for all ranks)",
            confidence=0.95, cause=ProbeCause.REQUIRES_GRAD_DIFFERS_ACROSS_RANKS,
        )
    if what == "dtype":
        fix = ("the model is cast on some ranks only (a .half()/.to(dtype) or a checkpoint loaded with assign=True "
               "inside a rank-dependent branch): cast on every rank, before parallelize; FSDP2 would all-gather and "
               "reduce-scatter buffers of different sizes across ranks")
    else:
        fix = "build the same architecture on every rank (a size computed from the rank or from per-rank data)"
    return Finding(
        severity="error",
        issue=f"{len(names)} tensor(s) have a different {what} across ranks before the first step: {_shown(names)}; "
              f"{format_ranks(odd)} differ",
        evidence="\n".join(lines), ranks=odd, fix=fix, confidence=0.95, cause=_LAYOUT_CAUSE[what],
    )


def divergence_findings(
    digests: dict[int, dict[str, TensorDigest]], skipped: set[str], experts: bool,
    after: dict[int, dict[str, AfterParallel]] | None = None,
) -> list[Finding]:
    """Tensors whose values differ across ranks before parallelize, as one finding with its cause
    (those that parallelize made equal, or replaced everywhere, as an info)."""
    ranks = sorted(digests)
    distinct = [d for d, _ in alike(ranks, [digests[r] for r in ranks])]
    keys = sorted({k for d in distinct for k in d} - skipped)
    differing = [k for k in keys if len({d[k]["bits"] for d in distinct if k in d}) > 1]
    if not differing:
        return []
    out: list[Finding] = []
    fate = {k: reach(k, after) for k in differing} if after else {}
    gone = [k for k in differing if fate.get(k) in ("healed", "rewritten")]
    if gone:
        out.append(Finding(
            severity="info",
            issue=f"{len(gone)} tensor(s) differ across ranks as built but not after parallelize: {_shown(gone)}",
            evidence=("after parallelize every rank holds the same values, or its slice of rank 0's copy (DDP broadcasts "
                      "rank 0's state at construction; a broadcast before fully_shard does the same), or values "
                      "parallelize wrote on every rank (a checkpoint load after fully_shard)"),
            cause=ProbeCause.SETUP_DIVERGENCE_HEALED_BY_PARALLELIZE,
        ))
        differing = [k for k in differing if k not in gone]
        if not differing:
            return out
    if experts:
        # Expert parallel: each rank builds its own experts, distinct by design on every rank.
        by_design = [k for k in differing if len({digests[r][k]["bits"] for r in ranks if k in digests[r]}) == len(ranks)]
        differing = [k for k in differing if k not in by_design]
        if by_design:
            out.append(Finding(
                severity="info",
                issue=f"{len(by_design)} tensor(s) are distinct on every rank, as expert-parallel weights are by design "
                      f"(the target declares route()): {_shown(by_design)}; not compared",
                cause=ProbeCause.EXPERT_WEIGHTS_RANK_DISTINCT,
            ))
        if not differing:
            return out
    div = classify(digests, differing)
    every = sorted({k for d in digests.values() for k in d})
    modules = outermost_modules(differing, every)
    lines = [_tensor_line(k, div.groups[k], digests) for k in differing[:8]]
    plural = "s" if len(differing) > 1 else ""
    carried = [k for k in differing if fate.get(k) == "carried"]
    if carried:
        lines.insert(0, f"after parallelize {len(carried)} of them still differ: each rank trains on its own values "
                        "(sharded ones: each rank kept its slice of its own copy, so the model is a mix)")
    out.append(Finding(
        severity="error",
        issue=(f"{len(differing)} parameter{plural}/buffer{plural} differ across ranks before the first step, in "
               f"{_shown(modules)}: {format_ranks(div.odd)} {'differs from the others' if len(div.odd) == 1 and len(ranks) > 2 else 'disagree'}"),
        evidence=f"{div.reason}\n" + "\n".join(lines) + (f"\n(+{len(differing) - 8} more)" if len(differing) > 8 else ""),
        ranks=div.odd, fix=FIXES[div.cause], confidence=div.confidence, cause=div.cause,
    ))
    return out


def _tensor_line(key: str, groups: dict[Any, list[int]], digests: dict[int, dict[str, TensorDigest]]) -> str:
    ordered = sorted(groups.values(), key=lambda g: (-len(g), g[0]))
    ref = digests[ordered[0][0]][key]
    parts = []
    for members in ordered[1:]:
        other = digests[members[0]][key]
        worst, ndiff, nsampled = sample_diff(ref, other)
        if nsampled == ref["numel"]:
            count = f"{ndiff} of {ref['numel']} elements differ"
        else:
            count = f"{ndiff} of {nsampled} sampled elements differ (~{round(ndiff / max(nsampled, 1) * ref['numel'])} of {ref['numel']})"
        parts.append(f"{format_ranks(members)} vs {format_ranks(ordered[0])}: max |diff| {worst:.4g}, {count}, "
                     f"sum {other['sum']:.6g} vs {ref['sum']:.6g}")
    return f"{key} {ref['shape']} {ref['dtype']} ({ref['kind']}): " + "; ".join(parts)


def _minority(groups: dict[Any, list[int]]) -> list[int]:
    return minority_ranks(groups) if len(groups) > 1 else []


def _shown(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


_MODE_SENSITIVE = ("Dropout", "BatchNorm", "InstanceNorm", "AlphaDropout")


def eval_modules(model: Any) -> list[str]:
    """The modules of the model as built that are in eval mode (canonical names, '(root)' for the model)."""
    from distdiag.probes.training import canonical_name

    return [canonical_name(n) or "(root)" for n, m in model.named_modules() if not m.training]


def mode_findings(payloads: dict[int, dict[str, Any]]) -> list[Finding]:
    """Modules in training mode on some ranks and eval mode on others (a validation pass on one rank
    that never calls model.train() again): dropout and batch norm then compute differently per rank."""
    modes: dict[int, Any] = {r: p.get("eval_modules") for r, p in payloads.items()}  # JSON lists, or None
    if any(m is None for m in modes.values()):
        return []
    groups = group_alike([(tuple(m), [r]) for r, m in sorted(modes.items())])
    if len(groups) < 2:
        return []
    everywhere = set.intersection(*(set(m) for m in modes.values()))
    differing = sorted(set.union(*(set(m) for m in modes.values())) - everywhere)
    lines = [f"{format_ranks(rs)}: {len(m)} module(s) in eval mode" + (f" ({_shown([x for x in m if x not in everywhere])})"
             if m else "") for m, rs in groups.items()]
    odd = sorted(r for r, m in modes.items() if set(m) - everywhere) or sorted(modes)
    return [Finding(
        severity="error",
        issue=f"{len(differing)} module(s) are in eval mode on some ranks and in training mode on others: {_shown(differing)}",
        evidence="\n".join(lines) + "\nmodel.eval() was called on some ranks only (a validation pass on rank 0, a "
                 "rank-dependent branch) and model.train() not called again: dropout is off and batch norm uses "
                 f"running statistics on those ranks only (mode-sensitive layers: {', '.join(_MODE_SENSITIVE)})",
        ranks=odd, fix="call model.train() on every rank before training (after any evaluation pass), or run the "
                       "evaluation on every rank", confidence=0.9, cause=ProbeCause.TRAINING_MODE_DIFFERS_ACROSS_RANKS,
    )]
