"""`sequence_parallel`: splits that lose or shift tokens, SP losses that differ from the unsplit one.

Three parts, each a finding that names ranks and token positions:
1. the split (the target's `split_sequence`, else the built-in contiguous and zigzag ones)
   on the batch and on a sequence one token longer: every (position, token, target) on
   exactly one rank, targets shifted before the split, global position ids, the mask split
   like the tokens (distdiag.probes.sequence_parallel.checks). The longer sequence is a length the probe
   made up, so what goes wrong only there is a warning naming the invariant the split relies
   on; on the target's own lengths it is an error;
2. a Ulysses all-to-all (sequence-sharded -> head-sharded and back) round trip and the
   attention computed that way, gathered back along the sequence;
3. end to end, with `parallelize_sp`: the SP model's loss, output and gradients on split
   inputs against the reference on the unsplit batch, for batches with uneven, empty and
   no valid targets (the built-in tiny LM when there is no target).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from distdiag.errors import ConfigError, exc_line
from distdiag.probes.base import (
    ConsolidationView,
    LocalFinding,
    Probe,
    group_ranks,
    local_finding,
    merge_local_findings,
)
from distdiag.probes.causes import ProbeCause
from distdiag.probes.sequence_parallel.checks import analyze_split
from distdiag.probes.sequence_parallel.diagnose import SpDiagnosis, diagnose_grads, diagnose_loss, diagnose_output
from distdiag.probes.sequence_parallel.end_to_end import VARIANT_TEXT, run_end_to_end
from distdiag.report.model import Finding, ProbeResult
from distdiag.report.render import format_ranks
from distdiag.workloads import sequence as seqw

if TYPE_CHECKING:
    from distdiag.runtime.context import RankContext

__all__ = ["SequenceParallelProbe", "SequenceParallelConfig", "attention_tolerance", "ulysses_attention"]

_MAX_ROWS = 2
"""Split checks look at the first rows of a user's batch only (they travel as JSON)."""


@dataclass
class SequenceParallelConfig:
    """Options of the sequence_parallel probe, the `[probes.sequence_parallel]` table."""

    splitter: str = "both"
    """Built-in split checked when the target has no split_sequence: contiguous, zigzag or both."""
    seq_len: int = 32
    """Sequence length of the built-in batch (used without make_batch), rounded up to a multiple
    of 2 x world size: a split that relies on divisible lengths is checked on one, and the
    probe's own one-longer variant shows what happens otherwise."""
    num_heads: int = 0
    """Heads of the Ulysses check; 0 means 2 x world size. Must divide by the world size."""
    rtol: float = 1e-4
    """Relative tolerance of loss, output and gradient comparisons (float32)."""

    def __post_init__(self) -> None:
        if self.splitter not in ("contiguous", "zigzag", "both"):
            raise ConfigError(f"probes.sequence_parallel.splitter must be contiguous, zigzag or both, got {self.splitter!r}")
        for key in ("seq_len", "num_heads"):
            value = getattr(self, key)
            low = 2 if key == "seq_len" else 0
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 1 << 16:
                raise ConfigError(f"probes.sequence_parallel.{key} must be an integer in [{low}, 65536], got {value!r}")
        if isinstance(self.rtol, bool) or not isinstance(self.rtol, int | float) or not 0 < self.rtol < 1:
            raise ConfigError(f"probes.sequence_parallel.rtol must be a number in (0, 1), got {self.rtol!r}")


def _lists(value: object) -> list[Any] | None:
    return value.tolist() if isinstance(value, torch.Tensor) else None


def _rows(value: object) -> object:
    """The rows the split checks compare (they travel as JSON)."""
    return value[:_MAX_ROWS] if isinstance(value, torch.Tensor) else value


def nominal_length(seq_len: int, world: int) -> int:
    """The built-in batch's length: `seq_len` rounded up to a multiple of 2 x world.

    A length the probe makes up must not be what trips a split that relies on divisible
    lengths (an invariant a collator usually keeps); the one-longer variant checks that case,
    as a warning.
    """
    step = 2 * world
    return -(-seq_len // step) * step


def _check_batch(batch: object, who: str) -> str | None:
    if not isinstance(batch, dict):
        return f"{who} must return a dict with input_ids and labels, got {type(batch).__name__}"
    for key in ("input_ids", "labels"):
        t = batch.get(key)
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype.is_floating_point:
            shown = f"{type(t).__name__}" if not isinstance(t, torch.Tensor) else f"{t.dtype} {list(t.shape)}"
            return f"{who}: {key} must be an integer tensor [batch, seq], got {shown}"
    if batch["labels"].shape != batch["input_ids"].shape:
        return f"{who}: labels {list(batch['labels'].shape)} and input_ids {list(batch['input_ids'].shape)} differ in shape"
    for key in ("position_ids", "attention_mask"):
        t = batch.get(key)
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != batch["input_ids"].shape):
            return f"{who}: {key} must be a tensor shaped like input_ids {list(batch['input_ids'].shape)}"
    return None


def _local_lists(out: object, rows: int) -> tuple[dict[str, Any] | None, str | None]:
    """This rank's split as lists (its first rows), or why the hook's result is unusable."""
    if not isinstance(out, dict) or not isinstance(out.get("input_ids"), torch.Tensor):
        return None, f"must return a dict with an input_ids tensor, got {type(out).__name__}"
    ids = out["input_ids"]
    if ids.dim() != 2 or ids.shape[0] != rows or ids.dtype.is_floating_point:
        return None, f"input_ids must be an integer tensor [{rows}, local_seq], got {ids.dtype} {list(ids.shape)}"
    res: dict[str, Any] = {"input_ids": ids[:_MAX_ROWS].tolist()}
    for key in ("shift_labels", "labels", "position_ids", "attention_mask"):
        t = out.get(key)
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != ids.shape):
            shown = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            return None, f"{key} must be a tensor shaped like input_ids {list(ids.shape)}, got {shown}"
        res[key] = _lists(_rows(t))
    return res, None


class SequenceParallelProbe(Probe):
    name = "sequence_parallel"
    checks_a_model = True
    summary = "sequence-parallel splits that lose or shift tokens, restart positions, or average per-rank losses"
    min_world_size = 2
    Config = SequenceParallelConfig

    def skip_reason(self, ctx: RankContext) -> str | None:
        """A target without sequence-parallel hooks has nothing of the user's to check: the probe
        would test only its built-in splits, and a PASS would say nothing of the target."""
        target = getattr(ctx, "target", None)
        if target is not None and not (target.has("split_sequence") or target.has("parallelize_sp")):
            return (f"nothing of yours to check: target {target.spec} has no split_sequence() or parallelize_sp() "
                    "hook (without --target the probe checks its built-in splits)")
        return None

    def run(self, ctx: RankContext) -> dict[str, Any]:
        opts: SequenceParallelConfig = self.options(ctx)
        rank, world = ctx.rank, ctx.world_size
        target = ctx.target
        findings: list[LocalFinding] = []
        ctx.seed()
        if target is not None and target.has("make_batch"):
            batch = target.make_batch(1)
            problem = _check_batch(batch, "make_batch(1)")
            if problem:
                findings.append(local_finding("error", f"sequence_parallel cannot use the target's batch: {problem}",
                                              fix="make_batch(step) returns {'input_ids': [B, S], 'labels': [B, S], ...} for this probe"))
                return {"findings": findings, "splits": [], "e2e": []}
            origin = "make_batch(1)"
        else:
            seq = nominal_length(opts.seq_len, world)
            batch = seqw.make_lm_batch(2, seq, 64, pad=seq // (2 * world) + 1, seed=0)
            origin = "the built-in batch"
        if target is not None and target.has("split_sequence"):
            splitters = {"split_sequence": target.split_sequence}
        else:
            names = ["contiguous", "zigzag"] if opts.splitter == "both" else [opts.splitter]
            splitters = {f"built-in {n}": seqw.SPLITTERS[n] for n in names}
        splits = []
        longer = _one_longer(batch)
        rows = int(batch["input_ids"].shape[0])
        for label, fn in splitters.items():
            # The split sees the whole batch (the user's, as make_batch returns it); only the first
            # rows of its result travel to the writing rank (as JSON).
            for variant, b in (("batch", batch), ("seq+1", longer)):
                entry: dict[str, Any] = {"splitter": label, "variant": variant, "seq_len": int(b["input_ids"].shape[1]),
                                         "origin": origin}
                try:
                    local, problem = _local_lists(fn(b, rank, world), rows)
                except Exception as exc:  # noqa: BLE001 - the user's split raising is a finding
                    # A split may issue collectives of its own: say so before Ulysses' all_to_all.
                    ctx.caught(exc, f"{label} on sequence length {entry['seq_len']}")
                    local, problem = None, f"raised {exc_line(exc)}"
                entry["local"], entry["problem"] = local, problem
                if rank == 0:
                    entry["full"] = {k: _lists(_rows(b.get(k))) for k in ("input_ids", "labels", "position_ids", "attention_mask")}
                splits.append(entry)
        ulysses = _ulysses(ctx, opts)
        e2e = run_end_to_end(ctx, target, batch, splitters, findings)
        return {"findings": findings, "splits": splits, "ulysses": ulysses, "e2e": e2e}

    def consolidate(self, payloads: dict[int, dict[str, Any]], view: ConsolidationView) -> ProbeResult:
        world = view.world_size
        findings = merge_local_findings(payloads)
        split = _split_findings(payloads, world)
        findings += split
        findings += _ulysses_findings(payloads)
        broken = any(f.severity == "error" for f in split)
        findings += _e2e_findings(payloads, world, self.options(view).rtol, broken)
        metrics: dict[str, Any] = {}
        first = payloads.get(0, {})
        if first.get("ulysses"):
            metrics["ulysses_max_abs_err"] = max(p.get("ulysses", {}).get("attn_err", 0.0) for p in payloads.values())
        if first.get("e2e"):
            metrics["e2e"] = [{"variant": v["variant"], "ref_loss": v.get("ref_loss"),
                               "sp_loss": _mean([p["e2e"][i].get("sp_loss") for p in payloads.values()])}
                              for i, v in enumerate(first["e2e"])]
        return ProbeResult.from_findings(self.name, findings, metrics=metrics)


def _one_longer(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch with one more position (a length the split may not divide)."""
    out = dict(batch)
    for key in ("input_ids", "labels", "attention_mask"):
        t = batch.get(key)
        if isinstance(t, torch.Tensor):
            out[key] = torch.cat([t, t[:, :1]], dim=1)
    pos = batch.get("position_ids")
    if isinstance(pos, torch.Tensor):
        out["position_ids"] = torch.cat([pos, pos[:, -1:] + 1], dim=1)
    return out


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _split_findings(payloads: dict[int, dict[str, Any]], world: int) -> list[Finding]:
    findings: list[Finding] = []
    entries0 = payloads.get(0, {}).get("splits", [])
    flagged: set[str] = set()
    for i, entry0 in enumerate(entries0):
        made_up = entry0["variant"] != "batch"
        if made_up and entry0["splitter"] in flagged:
            continue  # the uneven length would only repeat what the batch itself showed
        label = f"{entry0['splitter']!s}" + (" (seq len +1)" if made_up else "")
        seq_len = entry0["seq_len"]
        entries = {r: p["splits"][i] for r, p in payloads.items()}  # looked up once (16k ranks, issue 21)
        problems = {r: e["problem"] for r, e in entries.items() if e["problem"]}
        if problems:
            ranks = sorted(problems)
            raised = all(str(v).startswith("raised") for v in problems.values())
            lines = "\n".join(f"rank {r}: {v}" for r, v in sorted(problems.items()))
            if made_up and raised:
                findings.append(Finding(
                    "info", f"split {label} refuses sequence length {seq_len} at world size {world} on ranks {ranks}",
                    lines, ranks, f"pad sequences to a multiple of {world} (zigzag: {2 * world}) before the split", 0.95))
            elif made_up:
                findings.append(_made_up_length(entry0, world, "returns an unusable result", lines, ranks))
            else:
                flagged.add(entry0["splitter"])
                what = "refuses" if raised else "returns an unusable result for"
                findings.append(Finding(
                    "error", f"split {label} {what} sequence length {seq_len} at world size {world} on ranks {ranks}",
                    lines, ranks,
                    "split_sequence(batch, rank, world_size) returns a dict of [B, local_seq] tensors: input_ids, "
                    "shift_labels, position_ids and attention_mask when the batch has one", 0.95,
                    cause=ProbeCause.SPLIT_BAD_OUTPUT))
            continue
        local = {r: e["local"] for r, e in entries.items()}
        found = analyze_split(label, entry0["full"], local, world)
        bad = [f for f in found if f.severity != "info"]
        if bad and made_up:
            prefix = f"split {label}: "
            what = "; ".join(f.issue[len(prefix):] if f.issue.startswith(prefix) else f.issue for f in bad)
            evidence = "\n".join(f.evidence for f in bad if f.evidence)
            found = [f for f in found if f.severity == "info"]
            found.append(_made_up_length(entry0, world, what, evidence, sorted({r for f in bad for r in f.ranks})))
        elif bad:
            flagged.add(entry0["splitter"])
            if seq_len % world:
                note = f"{entry0.get('origin', 'the batch')} has sequences of length {seq_len}, which {world} ranks do not divide"
                for f in bad:
                    f.evidence = f"{f.evidence}\n{note}" if f.evidence else note
        findings += found
    return findings


def _made_up_length(entry0: dict[str, Any], world: int, what: str, evidence: str, ranks: list[int]) -> Finding:
    """What a split does wrong on the probe's own one-longer length: a warning, with the invariant.

    The split was right on the target's lengths (else this variant is not looked at): whether
    the length breaks training depends on whether batches of that length can occur.
    """
    n, origin = entry0["seq_len"], entry0.get("origin", "the batch")
    undivided = n % world != 0
    issue = (f"split {entry0['splitter']} on sequence length {n}, a length distdiag made up (one more than {origin}'s "
             f"{n - 1}" + (f"; {world} ranks do not divide it" if undivided else "") + f"): {what}")
    if undivided:
        fix = (f"the split is right on {origin}'s length and relies on every sequence length dividing by {world} "
               f"({2 * world} for a load-balanced zigzag split): keep that invariant where batches are made (pad to a "
               f"multiple of {world} in the collator) and assert it in split_sequence (raise when seq_len % world_size "
               "!= 0), so a batch that breaks it fails loudly instead of training on lost tokens")
    else:
        fix = (f"the split is right on {origin}'s length but not on {n}: make sure training batches only have lengths "
               "it handles (pad in the collator) and make split_sequence raise on any other length")
    return Finding("warning", issue, evidence, ranks, fix, 0.8, cause=ProbeCause.SPLIT_NEEDS_DIVISIBLE_LENGTH)


def _ulysses_findings(payloads: dict[int, dict[str, Any]]) -> list[Finding]:
    findings = []
    info = {r: p.get("ulysses") or {} for r, p in payloads.items()}
    if any(v.get("problem") for v in info.values()):
        return [Finding("warning", f"Ulysses check not run: {info[0].get('problem', '')}", ranks=[],
                        fix="use a head count divisible by the sequence-parallel world size")]
    bad_trip = sorted(r for r, v in info.items() if v and not v.get("round_trip_exact", True))
    if bad_trip:
        findings.append(Finding(
            "error", f"the Ulysses all_to_all round trip (sequence -> heads -> sequence) is not exact on ranks {bad_trip}",
            "\n".join(f"rank {r}: max abs error {info[r]['round_trip_err']:g}" for r in bad_trip), bad_trip,
            "all_to_all_single returns wrong data: rerun the collectives probe and check the transport", 0.9,
            cause=ProbeCause.TRANSPORT_CORRUPTS_DATA))
    for key, what in (("attn_err", "attention through the Ulysses all_to_all"), ("gather_err", "the shards gathered along the sequence")):
        bad = sorted(r for r, v in info.items() if v and v.get(key, 0.0) > v.get("tol", 1e-4))
        if bad:
            findings.append(Finding(
                "error", f"{what} differs from unsharded attention on ranks {bad}",
                "\n".join(f"rank {r}: max abs error {info[r][key]:g} (tolerance {info[r]['tol']:g}) at sequence positions "
                          f"{info[r].get(key + '_positions', [])}" for r in bad), bad,
                "the head/sequence layout of the all_to_all is wrong or the transport corrupts data", 0.9))
    return findings


def _by_text(per_rank: dict[int, str]) -> str:
    """One line per distinct text, naming the ranks that reported it."""
    groups = group_ranks(sorted(per_rank), per_rank.__getitem__)
    return "\n".join(f"{format_ranks(rs)}: {text}" for text, rs in groups.items())


def _e2e_findings(payloads: dict[int, dict[str, Any]], world: int, rtol: float, split_broken: bool) -> list[Finding]:
    """One finding per kind of problem, its evidence listing every batch variant it showed on."""
    kinds = _ByKind()
    first = payloads.get(0, {}).get("e2e", [])
    unmasked = {r: (p["e2e"][0].get("unmasked_mismatch") if p.get("e2e") else None) for r, p in payloads.items()}
    ctx = _E2eContext(split_broken, unmasked)
    for i, v0 in enumerate(first):
        per = {r: p["e2e"][i] for r, p in payloads.items()}
        _variant_problems(kinds, v0, per, world, rtol, ctx)
    return kinds.findings()


class _ByKind:
    """End-to-end problems grouped by kind (in the order first seen), with the batch variants each showed on."""

    def __init__(self) -> None:
        self.kinds: dict[str, _Kind] = {}

    def add(self, kind: str, issue: str, variant: str, evidence: str, ranks: list[int], fix: str, conf: float = 0.9,
            severity: str = "error", cause: ProbeCause | None = None) -> None:
        entry = self.kinds.setdefault(kind, _Kind(issue, fix, conf, severity, cause))
        entry.variants.append(variant)
        entry.evidence.append(f"[{variant} batch] {evidence}")
        entry.ranks.update(ranks)

    def findings(self) -> list[Finding]:
        return [
            Finding(k.severity, f"{k.issue} ({', '.join(k.variants)} batch{'es' if len(k.variants) > 1 else ''})",
                    "\n".join(k.evidence), sorted(k.ranks), k.fix, k.conf, cause=k.cause or "")
            for k in self.kinds.values()
        ]


@dataclass
class _Kind:
    """One kind of end-to-end problem: the first issue, fix and confidence seen, and every
    batch variant, evidence line and rank that showed it."""

    issue: str
    fix: str
    conf: float
    severity: str
    cause: ProbeCause | None
    variants: list[str] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    ranks: set[int] = field(default_factory=set)


@dataclass
class _E2eContext:
    """What every batch variant's diagnosis reads besides its own results."""

    split_broken: bool
    """The target's split has an error finding: end-to-end differences follow from it."""
    unmasked: dict[int, Any]
    """Per rank, whether the output still differed with the mask all ones (None: not run)."""


def _variant_problems(kinds: _ByKind, v0: dict[str, Any], per: dict[int, dict[str, Any]], world: int, rtol: float,
                      ctx: _E2eContext) -> None:
    """Add what one batch variant's results (`per` rank; `v0` is rank 0's) show to `kinds`."""
    variant = v0["variant"]
    shapes = {r: v["output_problem"] for r, v in per.items() if v.get("output_problem")}
    if shapes:
        kinds.add("shape", f"the SP model's output has the wrong shape on ranks {sorted(shapes)}", variant,
                  _by_text(shapes), sorted(shapes),
                  "gather sequence shards along the sequence dim (dim 1 of [batch, seq, ...]) in rank order", 0.95,
                  cause=ProbeCause.SP_GATHER_WRONG_DIM)
    errors = {r: v["error"] for r, v in per.items() if v.get("error")}
    if errors:
        kinds.add("error", f"the SP step failed on ranks {sorted(errors)}", variant,
                  _by_text(errors), sorted(errors),
                  "parallelize_sp(model, mesh) and loss_fn(model, local_batch) must run on the split batch")
        return
    if any(v.get("skipped") for v in per.values()):
        return
    ref_ok = math.isfinite(v0["ref_loss"])
    if not ref_ok:
        _reference_not_finite(kinds, v0, per)
    mism = {r: v["output_mismatch"] for r, v in per.items() if v.get("output_mismatch")}
    # The output off (or the split, found above) explains a loss and gradients that differ:
    # only loss-specific mechanisms are said on their own then, never a loss-weighting fix.
    upstream = bool(mism or shapes or ctx.split_broken)
    problem = _loss_differs(kinds, v0, per, ref_ok, rtol, upstream)
    if mism and not ctx.split_broken:
        d = diagnose_output(mism, ctx.unmasked)
        kinds.add(d.kind, d.issue, variant, d.evidence, sorted(mism), d.fix, d.confidence, cause=d.cause)
    if ref_ok and not upstream:
        _grads_differ(kinds, variant, per, world, rtol, problem)


def _reference_not_finite(kinds: _ByKind, v0: dict[str, Any], per: dict[int, dict[str, Any]]) -> None:
    """A warning that loss_fn is not finite on a batch variant the probe made."""
    # The probe made this batch by ignoring targets: the user's own (unsplit) loss is not
    # finite on it, so there is nothing to hold the SP loss and gradients against.
    variant = v0["variant"]
    sp = [per[r].get("sp_loss") for r in sorted(per)]
    kinds.add("ref-nan", f"loss_fn returns {v0['ref_loss']} on the unsplit batch when "
              f"{VARIANT_TEXT.get(variant, variant)} (a batch distdiag made from the target's)", variant,
              f"reference loss {v0['ref_loss']}; SP losses per rank {sp}; SP loss and gradients not compared on it",
              [], "if a batch or micro-batch can have no valid target in training (all padding, fully masked prompts), its "
              "step turns the weights to NaN: divide the summed token loss by max(valid targets, 1)", 0.7, "warning",
              cause=ProbeCause.EMPTY_BATCH_ZERO_DIVISION)


def _loss_differs(kinds: _ByKind, v0: dict[str, Any], per: dict[int, dict[str, Any]], ref_ok: bool,
                  rtol: float, upstream: bool) -> SpDiagnosis | None:
    """Add the SP loss's difference from the reference (when the reference is finite) and return its diagnosis.

    With `upstream` (the output or the split already wrong) only a loss-specific mechanism is
    added: a generic difference follows from what is upstream and has its own finding.
    """
    if not ref_ok:
        return None
    valid = {r: v["valid"] for r, v in per.items()}
    sums = {r: v["ref_shard_sum"] for r, v in per.items()} if all(v.get("ref_shard_sum") is not None for v in per.values()) else None
    d = diagnose_loss(v0["ref_loss"], {r: v["sp_loss"] for r, v in per.items()}, valid, sums, rtol, len(per))
    if d is not None and (d.cause or not upstream):
        kinds.add(d.kind, d.issue, v0["variant"], d.evidence, sorted(per), d.fix, d.confidence, cause=d.cause)
    return d


def _grads_differ(kinds: _ByKind, variant: str, per: dict[int, dict[str, Any]], world: int, rtol: float,
                  loss_problem_found: SpDiagnosis | None) -> None:
    """Rank 0's SP gradients: not finite, or off (only said when the loss was not already off)."""
    g = per[0].get("grad") or {}
    if not g.get("finite", True) or (g.get("rel_err", 0.0) > rtol * 10 and not loss_problem_found):
        d = diagnose_grads(g, world)
        kinds.add(d.kind, d.issue, variant, d.evidence, sorted(per), d.fix, d.confidence, cause=d.cause)


def attention_tolerance(device: torch.device) -> float:
    """The largest absolute error allowed between the Ulysses attention and the unsharded one,
    both computed on `device` from the same float32 inputs of size ~1: on the CPU the same
    kernels agree to rounding (1e-5); a GPU picks other kernels for a head subset than for all
    heads (1e-4), and with TF32 matmuls (`torch.backends.cuda.matmul.allow_tf32`, or a float32
    matmul precision below "highest") keeps 10 mantissa bits (1e-2). A routing bug (a head or a
    sequence shard in the wrong place) is an error of order 1 either way."""
    if device.type == "cpu":
        return 1e-5
    if device.type == "cuda" and (torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"):
        return 1e-2
    return 1e-4


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, sl: slice, world: int,
                      a2a: Callable[..., object], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(this rank's queries back from head sharding, its attention output through the Ulysses
    all_to_all, the unsharded attention over every position), all on `device`: the reference is
    computed where the sharded one is (a GPU's kernels against the CPU's differ by more than any
    tight tolerance), and the positions go there too (a mask on the CPU beside GPU scores raises)."""
    pos = pos.to(device)
    q_heads = seqw.seq_to_heads(q[:, sl].contiguous().to(device), world, a2a)
    back = seqw.heads_to_seq(q_heads, world, a2a)
    kh, vh = (seqw.seq_to_heads(t[:, sl].contiguous().to(device), world, a2a).transpose(1, 2) for t in (k, v))
    out = seqw.heads_to_seq(seqw.attention(q_heads.transpose(1, 2), kh, vh, pos, pos).transpose(1, 2).contiguous(), world, a2a)
    fq, fk, fv = (t.to(device).transpose(1, 2) for t in (q, k, v))
    ref = seqw.attention(fq, fk, fv, pos, pos).transpose(1, 2)
    return back, out, ref


def _ulysses(ctx: RankContext, opts: SequenceParallelConfig) -> dict[str, Any]:
    """Sequence -> head sharding and back over all_to_all; attention against the unsharded one."""
    world, rank = ctx.world_size, ctx.rank
    heads = opts.num_heads or 2 * world
    if heads % world:
        return {"problem": f"{heads} heads do not divide by the SP world size {world}"}
    seq_local, dim = 4, 8
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, seq_local * world, heads, dim, generator=gen) for _ in range(3))
    pos = torch.arange(seq_local * world)[None]
    sl = slice(rank * seq_local, (rank + 1) * seq_local)
    back_dev, out_dev, ref_dev = ulysses_attention(q, k, v, pos, sl, world, ctx.comm.all_to_all_single, ctx.device)
    back, ref = back_dev.cpu(), ref_dev.cpu()
    trip_err = float((back - q[:, sl]).abs().max())
    err = (out_dev.cpu() - ref[:, sl]).abs()
    parts = [torch.empty_like(out_dev) for _ in range(world)]
    ctx.comm.all_gather(parts, out_dev)
    gathered = torch.cat([p.cpu() for p in parts], dim=1)
    gerr = (gathered - ref).abs()
    tol = attention_tolerance(ctx.device)
    return {
        "round_trip_exact": bool(torch.equal(back, q[:, sl])), "round_trip_err": trip_err,
        "attn_err": float(err.max()), "gather_err": float(gerr.max()), "tol": tol,
        "attn_err_positions": [rank * seq_local + int(i) for i in (err.amax(dim=(0, 2, 3)) > tol).nonzero().flatten()[:8]],
        "gather_err_positions": [int(i) for i in (gerr.amax(dim=(0, 2, 3)) > tol).nonzero().flatten()[:8]],
    }
