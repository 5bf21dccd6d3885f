"""Pure checks on the values one look of the monitor gathered: each returns (key, Finding).

The key dedupes: the monitor reports a finding once, with the first step it was seen, and
counts the later looks that saw it again. No torch here: these take plain numbers, so they
are unit-tested directly.
"""

from __future__ import annotations

import math
from collections import Counter

from distdiag.analyze.series import median
from distdiag.monitor.config import MonitorConfig
from distdiag.report.model import Finding

__all__ = ["ComponentHistory", "param_findings", "kind_imbalance", "agreement", "grad_checks", "component_checks", "code_checks", "entropy_checks", "update_checks"]

Keyed = list[tuple[str, Finding]]


def _g(x: float) -> str:
    return f"{x:.4g}"


def _disagreeing(values: dict[int, float], rtol: float) -> tuple[list[int], bool]:
    """Ranks off the median by more than rtol, and whether they are a clear minority."""
    med = median(list(values.values()))
    off = [r for r, v in values.items() if abs(v - med) > rtol * max(abs(med), 1e-30)]
    return sorted(off), 0 < len(off) < len(values) / 2


def _leave_one_out_medians(values: dict[int, float]) -> dict[int, float]:
    """For each key, the median of the other values: one sort, then each by index (not n sorts)."""
    order = sorted(values, key=values.__getitem__)
    ordered = [values[k] for k in order]
    m = len(ordered) - 1

    def at(k: int, skip: int) -> float:
        return ordered[k if k < skip else k + 1]

    out = {}
    for i, key in enumerate(order):
        mid = m // 2
        out[key] = at(mid, i) if m % 2 else 0.5 * (at(mid - 1, i) + at(mid, i))
    return out


def agreement(rows: dict[int, dict], cfg: MonitorConfig, step: int) -> Keyed:
    """Cross-rank checks. rows: global rank -> {step, loss, grad_bad, grad_plain, param_plain, has_plain}."""
    if len(rows) < 2:
        return []
    return [*_step_agreement(rows), *_nonfinite_agreement(rows, step), *_replica_agreement(rows, cfg, step), *_loss_outliers(rows, cfg, step)]


def _step_agreement(rows: dict[int, dict]) -> Keyed:
    """Ranks that called the monitor at another step than the most common one."""
    steps = {r: row["step"] for r, row in rows.items()}
    # ties: the step of the lowest rank among the most common (was: set order, unspecified)
    mode = Counter(steps.values()).most_common(1)[0][0]
    odd = sorted(r for r, s in steps.items() if s != mode)
    if not odd:
        return []
    return [(
        "agree:step",
        Finding(
            "error",
            f"rank(s) {', '.join(map(str, odd))} called the monitor at another step than the others ({', '.join(f'rank {r}: {int(steps[r])}' for r in odd)}; others: {int(mode)})",
            "the monitor's all_reduce pairs calls by order: the ranks' loops are out of step",
            odd,
            fix="Call monitor.after_backward on every rank at every step with the same step number.",
        ),
    )]


def _nonfinite_agreement(rows: dict[int, dict], step: int) -> Keyed:
    """Some ranks, not all, with a non-finite loss or non-finite gradients."""
    out: Keyed = []
    bad_loss = sorted(r for r, row in rows.items() if not math.isfinite(row["loss"]))
    if bad_loss and len(bad_loss) < len(rows):
        good = [r for r in rows if r not in bad_loss]
        out.append((
            "agree:loss_nonfinite",
            Finding(
                "error",
                f"rank(s) {', '.join(map(str, bad_loss))} see a non-finite loss at step {step} while rank(s) {', '.join(map(str, good))} see finite ones",
                "; ".join(f"rank {r}: loss {_g(rows[r]['loss'])}" for r in sorted(rows)),
                bad_loss,
                fix="The data shard or the forward of those ranks produced it: see the trace finding for the module.",
            ),
        ))
    bad_grad = sorted(r for r, row in rows.items() if row["grad_bad"])
    if bad_grad and len(bad_grad) < len(rows):
        out.append((
            "agree:grad_nonfinite",
            Finding(
                "error",
                f"rank(s) {', '.join(map(str, bad_grad))} hold non-finite gradients at step {step}, the other ranks do not",
                "gradients of replicas are reduced together: a difference means the reduction did not cover them",
                bad_grad,
                fix="Check that every parameter's gradient is reduced (DDP/FSDP wraps the whole model) on every rank.",
            ),
        ))
    return out


def _replica_agreement(rows: dict[int, dict], cfg: MonitorConfig, step: int) -> Keyed:
    """Replicated (plain-tensor) gradient and parameter norms that differ across ranks."""
    out: Keyed = []
    for key, label in (("grad_plain", "gradient norm"), ("param_plain", "parameter norm")):
        vals = {r: row[key] for r, row in rows.items() if row["has_plain"] and math.isfinite(row[key])}
        if len(vals) < 2:
            continue
        off, minority = _disagreeing(vals, cfg.rank_rtol)
        if not off:
            continue
        named = off if minority else sorted(vals)
        out.append((
            f"agree:{key}",
            Finding(
                "error",
                (f"rank(s) {', '.join(map(str, off))} disagree with the others on the replicated {label} at step {step}" if minority
                 else f"ranks {', '.join(map(str, named))} disagree on the replicated {label} at step {step} (no majority to tell which is wrong)"),
                "; ".join(f"rank {r}: {_g(v)}" for r, v in sorted(vals.items())) + f" (relative tolerance {cfg.rank_rtol:g})",
                named,
                fix="Replicas must stay identical: check that gradients are all-reduced on every rank, that parameters were broadcast at start, "
                "and that no rank-dependent code touches the model.",
                confidence=0.9 if minority else 0.6,
            ),
        ))
    return out


def _loss_outliers(rows: dict[int, dict], cfg: MonitorConfig, step: int) -> Keyed:
    """Each rank whose finite loss is far above the median of the other ranks' losses."""
    out: Keyed = []
    losses = {r: row["loss"] for r, row in rows.items() if math.isfinite(row["loss"])}
    if len(losses) < 2:
        return out
    loo = _leave_one_out_medians(losses)
    for r, v in sorted(losses.items()):
        others = loo[r]
        if others > 0 and v > cfg.loss_outlier_factor * others:
            out.append((
                f"agree:loss_outlier:{r}",
                Finding(
                    "warning",
                    f"rank {r}'s loss {_g(v)} at step {step} is {v / others:.0f}x the other ranks' median {_g(others)}",
                    "; ".join(f"rank {q}: {_g(x)}" for q, x in sorted(losses.items())),
                    [r],
                    fix="Check that rank's data shard (a corrupt file, a wrong label mapping) and its inputs' preprocessing.",
                    confidence=0.7,
                ),
            ))
    return out


def grad_checks(total: float, groups: dict[str, float], cfg: MonitorConfig, step: int, first: bool = False) -> Keyed:
    """Vanishing/exploding total and per-group norms. At the first look (before any update) a
    group's gradient may be exactly 0 by design (a zero-initialised head or LoRA B blocks the
    gradient of what is upstream of it): per-group vanishing is judged from the second look."""
    out: Keyed = []
    if not math.isfinite(total):
        return out  # the non-finite finding covers it
    if total < cfg.vanish_below:
        out.append(("grad:vanish", Finding("warning", f"gradient norm {_g(total)} at step {step} is below {cfg.vanish_below:g}: vanishing gradients",
                                           fix="Check for saturated activations, a detached graph, a zero learning-rate scale or loss.")))
    elif total > cfg.explode_above:
        out.append(("grad:explode", Finding("warning", f"gradient norm {_g(total)} at step {step} is above {cfg.explode_above:g}: exploding gradients",
                                            fix="Clip gradients, lower the learning rate, check normalisation and the loss scale.")))
    for name, v in groups.items():
        if total >= cfg.vanish_below and v < cfg.vanish_below and not first:
            out.append((f"grad:vanish:{name}", Finding("warning", f"gradient norm of {name} is {_g(v)} at step {step}, below {cfg.vanish_below:g}",
                                                       f"total gradient norm {_g(total)}",
                                                       fix=f"{name} barely learns: check that its output reaches the loss and is not detached or saturated.")))
        elif total <= cfg.explode_above and v > cfg.explode_above:
            out.append((f"grad:explode:{name}", Finding("warning", f"gradient norm of {name} is {_g(v)} at step {step}, above {cfg.explode_above:g}",
                                                        fix="Clip gradients; check that module's initialisation and normalisation.")))
    return out


def kind_imbalance(kinds: dict[str, dict[str, float]], cfg: MonitorConfig, step: int) -> Keyed:
    """Gradient norms of parameters of the same kind (the same projection in each layer) that
    differ by `imbalance_ratio`: gradients vanishing or exploding along the depth. Parameters
    of different kinds (a whole stack against one norm vector) are not comparable."""
    out: Keyed = []
    for kind, norms in kinds.items():
        hi = max(norms, key=norms.__getitem__)
        lo = min(norms, key=norms.__getitem__)
        if norms[hi] < cfg.imbalance_ratio * norms[lo]:
            continue
        out.append((f"grad:imbalance:{kind}", Finding(
            "warning",
            f"gradient norms of the same kind of parameter ({kind}) are imbalanced at step {step}: {hi} {_g(norms[hi])} is {norms[hi] / norms[lo]:.0f}x {lo} {_g(norms[lo])}",
            f"{len(norms)} parameters of that kind: " + ", ".join(f"{n} {_g(v)}" for n, v in list(norms.items())[:8]),
            fix="Gradients vanish or explode along the depth: check the initialisation scale, normalisation layers and residual connections.",
            confidence=0.6,
        )))
    return out


def update_checks(ratio: float, cfg: MonitorConfig, step: int) -> Keyed:
    if not math.isfinite(ratio):
        return []
    if ratio > cfg.update_ratio_high:
        return [("update:high", Finding("warning", f"one update changed the parameters by {ratio:.3g} of their norm at step {step} (above {cfg.update_ratio_high:g})",
                                        "update norm / parameter norm; about 1e-3 is usual", fix="Lower the learning rate or lengthen warmup."))]
    if ratio < cfg.update_ratio_low:
        return [("update:low", Finding("warning", f"one update changed the parameters by only {ratio:.3g} of their norm at step {step} (below {cfg.update_ratio_low:g})",
                                       "update norm / parameter norm", fix="Check the learning rate (schedule at 0?) and that the optimizer holds these parameters."))]
    return []


class ComponentHistory:
    """What component checks need from earlier looks: how many looks in a row each term has
    been exactly 0 and since which step, and each term's reference value.

    The first look comes before any optimizer update (step 0): a term that is 0 there (a KL
    of an encoder initialised to the prior) says nothing yet, so that look starts no zero run
    and gives no reference. A term's reference is its first finite non-zero value after it.
    """

    def __init__(self) -> None:
        self.looks = 0
        self.zero_since: dict[str, tuple[int, int]] = {}
        """term -> (first step of its current run of exact zeros, looks in that run)."""
        self.ref: dict[str, tuple[int, float]] = {}
        """term -> (step, value) it is scale-normalised by."""
        self.seen: dict[str, int] = {}
        """term -> looks since its reference."""

    def update(self, values: dict[str, float], step: int) -> None:
        self.looks += 1
        if self.looks == 1:
            return
        for name, v in values.items():
            if v == 0.0:
                first, n = self.zero_since.get(name, (step, 0))
                self.zero_since[name] = (first, n + 1)
            else:
                self.zero_since.pop(name, None)
            if name in self.ref:
                self.seen[name] += 1
            elif math.isfinite(v) and v != 0.0:
                self.ref[name], self.seen[name] = (step, v), 0


def component_checks(values: dict[str, float], cfg: MonitorConfig, step: int, hist: ComponentHistory) -> Keyed:
    """A term exactly 0 for `zero_looks` looks in a row after the first update (a dead path),
    and (info) a term that stays at its starting scale while another falls `component_ratio` times
    further (each divided by its own reference value: raw magnitudes of different terms are
    in different units, and a term's weight scales its value and its gradient alike)."""
    hist.update(values, step)
    out: Keyed = []
    if len(values) < 2:
        return out
    shown = ", ".join(f"{k}={_g(x)}" for k, x in values.items())
    for name, (first, n) in hist.zero_since.items():
        if n >= cfg.zero_looks and name in values:
            out.append((f"component:zero:{name}", Finding(
                "warning", f"loss component {name!r} has been exactly 0 at the {n} looks from step {first} to step {step}: a dead path",
                f"{shown}; a term that is 0 before the first update (step 0) is not counted",
                fix="Check that this term's inputs are produced (e.g. routing or masking never selects them), that the parameters it "
                "depends on are in the optimizer and trainable, and that its weight is not 0.")))
    out += _drowned(values, cfg, step, hist, shown)
    return out


def _drowned(values: dict[str, float], cfg: MonitorConfig, step: int, hist: ComponentHistory, shown: str) -> Keyed:
    """A term that has not halved from its reference after `zero_looks` looks while another fell
    to 1/component_ratio of it (GradNorm's relative loss L(t)/L(0): a scale-free training rate).
    Info only: a term that is slow to train, or one pushed up by the other (a VAE's KL), looks the
    same in values; telling them from a drowned gradient needs one backward per term."""
    rel = {k: (v / hist.ref[k][1], hist.ref[k][0]) for k, v in values.items()
           if k in hist.ref and hist.seen[k] >= cfg.zero_looks and math.isfinite(v)}
    stuck = [(r, k) for k, (r, _) in rel.items() if r >= 0.5]
    moved = [(r, k) for k, (r, _) in rel.items() if r > 0]
    if not stuck or not moved:
        return []
    (r_hi, hi), (r_lo, lo) = max(stuck), min(moved)
    if r_hi < cfg.component_ratio * r_lo:
        return []
    return [(f"component:dominant:{lo}", Finding(
        "info",
        f"loss component {lo!r} dominates training at step {step}: it fell to {r_lo:.3g} of its value at step {rel[lo][1]} "
        f"while {hi!r} is still {r_hi:.3g} of its value at step {rel[hi][1]}",
        f"{shown}; each term divided by its own first non-zero value after step 0 (raw magnitudes of different terms are not comparable)",
        fix=f"{hi!r} barely trains: raise its weight, or normalise the terms (e.g. per-term running scale) so that its gradients are not drowned.",
        confidence=0.6,
    ))]


def code_checks(stats: dict[str, float], num_codes: int, cfg: MonitorConfig, step: int) -> Keyed:
    """Codes used out of those that could be used: a look that saw T assignments can use at
    most min(num_codes, T) codes (64 tokens over 512 codes is 12.5% at best, not a collapse)."""
    out: Keyed = []
    tokens = int(stats.get("tokens", 0))
    if tokens <= 0:
        return out
    used_n = round(stats["used_frac"] * num_codes)
    possible = min(num_codes, tokens)
    used = used_n / possible
    if used < cfg.code_use_low:
        out.append(("codes:collapse", Finding(
            "warning",
            f"only {used_n} of the {num_codes} codes are used at step {step} ({used:.1%} of the {possible} that {tokens} assignments could use, "
            f"below {cfg.code_use_low:.0%}): codebook/expert collapse",
            f"perplexity {stats['perplexity']:.3g} of {num_codes}; top code {int(stats['top_code'])} takes {stats['top_share']:.1%} of {tokens} assignments",
            fix="Add or raise a load-balancing / commitment loss, re-initialise dead codes, lower the learning rate of the router.",
        )))
    if num_codes >= 3 and stats["top_share"] >= cfg.code_monopoly:
        out.append(("codes:monopoly", Finding(
            "warning",
            f"code {int(stats['top_code'])} takes {stats['top_share']:.1%} of all assignments at step {step} (at least {cfg.code_monopoly:.0%})",
            f"{used_n} of {num_codes} codes used, perplexity {stats['perplexity']:.3g}",
            fix="Balance the assignments: an auxiliary load-balancing loss or capacity limits.",
        )))
    return out


def entropy_checks(mean_nats: float, vocab: int, cfg: MonitorConfig, step: int, marginal: float = math.nan) -> Keyed:
    """Near-uniform output at each position (after the grace steps: it is expected at
    initialisation), or output collapsed onto few tokens: judged on the marginal entropy (of the
    predictions of all positions together), since a healthy model confident of a different next
    token at each position has a low per-position entropy too."""
    if vocab < 2 or not math.isfinite(mean_nats):
        return []
    frac = mean_nats / math.log(vocab)
    if frac >= cfg.entropy_high and step >= cfg.entropy_grace_steps:
        return [("entropy:high", Finding("warning", f"output entropy {mean_nats:.3g} nats at step {step} is {frac:.0%} of log(vocab={vocab}): near-uniform, gibberish output",
                                         fix="The model is not learning the token distribution: check labels shift, the learning rate and the loss masking."))]
    mfrac = marginal / math.log(vocab) if math.isfinite(marginal) else frac
    if mfrac <= cfg.entropy_low:
        return [("entropy:low", Finding("warning", f"output collapsed onto few tokens at step {step}: the predictions of all positions together have entropy {marginal:.3g} nats, {mfrac:.1%} of log(vocab={vocab})",
                                        f"mean entropy per position {mean_nats:.3g} nats ({frac:.1%}); a model sure of a different token at each position has a low entropy per position, not a low marginal one",
                                        fix="Check for a degenerate target (all padding?), too high a learning rate, or missing label smoothing."))]
    return []


def param_findings(counts: list[dict], emb_names: list[str], emb_params: int) -> Keyed:
    """The parameter table (info) and a warning when the embedding tables and the output
    projections onto their vocabulary hold at least half of the parameters."""
    total = sum(r["params"] for r in counts)
    table = ", ".join(f"{r['module']} {r['params']:,} ({r['share']:.0%})" for r in counts[:8])
    out: Keyed = [("params:table", Finding("info", f"{total:,} parameters; by module: {table}", confidence=1.0))]
    if total and emb_params * 2 >= total:
        who = " + ".join(emb_names[:4]) + (" ..." if len(emb_names) > 4 else "")
        out.append(("params:embedding", Finding(
            "warning", f"embeddings hold most of the parameters: {who} {'have' if len(emb_names) > 1 else 'has'} {emb_params:,} of {total:,} ({emb_params / total:.0%})",
            "embedding tables (nn.Embedding) and the Linear layers with a table's shape (the output head onto the vocabulary), found at any depth",
            fix="The model's capacity sits in a lookup table: consider tying input/output embeddings, a smaller vocabulary, or a deeper body.",
            confidence=0.7)))
    return out
