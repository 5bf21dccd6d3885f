"""Pure checks of sequence-parallel splits and results (no collectives; unit-testable).

`analyze_split` compares what every rank got from a split with the unsplit batch, as
(global position, input token, target) triples; `output_shape_problem` explains an SP
output of the wrong shape; `loss_problem` explains an SP loss that differs from the
reference, using the per-rank valid-token counts.
"""

from __future__ import annotations

import math
from typing import Any

from distdiag.report.model import Finding
from distdiag.report.render import format_ranks

__all__ = ["analyze_split", "output_shape_problem", "loss_problem", "positions_text", "IGNORE"]

IGNORE = -100
_SHOW = 8


def positions_text(items: list[Any]) -> str:
    shown = ", ".join(str(i) for i in items[:_SHOW])
    return shown + (f", ... ({len(items)} in all)" if len(items) > _SHOW else "")


def _finding(severity: str, issue: str, evidence: str, ranks: list[int], fix: str) -> Finding:
    return Finding(severity=severity, issue=issue, evidence=evidence, ranks=ranks, fix=fix, confidence=0.95)


def analyze_split(label: str, full: dict[str, Any], local: dict[int, dict[str, Any]], world: int) -> list[Finding]:
    """Findings about one split: `full` and each rank's `local` hold nested lists [B][S]."""
    ids, labels = full["input_ids"], full["labels"]
    batch, seq = len(ids), len(ids[0])
    mask = full.get("attention_mask")
    full_pos = full.get("position_ids") or [list(range(seq)) for _ in range(batch)]
    where_pos = {b: {p: i for i, p in enumerate(full_pos[b])} for b in range(batch)}
    findings: list[Finding] = []
    owners: dict[tuple[int, int], list[int]] = {}
    token_bad: dict[int, list[str]] = {}
    target_bad: dict[int, list[str]] = {}
    boundary_lost: dict[int, list[int]] = {}
    mask_bad: dict[int, list[int]] = {}
    restart = []
    no_shift = [r for r in sorted(local) if local[r].get("shift_labels") is None]
    no_pos = [r for r in sorted(local) if local[r].get("position_ids") is None]
    offset = 0
    for r in sorted(local):
        loc = local[r]
        lids = loc["input_ids"]
        width = len(lids[0]) if lids else 0
        pos = loc.get("position_ids") or [list(range(offset, offset + width)) for _ in range(batch)]
        offset += width
        if r > 0 and loc.get("position_ids") is not None and width and all(row and row[0] == 0 for row in pos):
            restart.append(r)
        if loc.get("shift_labels") is not None:
            tgts = loc["shift_labels"]
        else:  # what a model that shifts its own labels would train on
            lab = loc.get("labels") or [[IGNORE] * width for _ in range(batch)]
            tgts = [row[1:] + [IGNORE] for row in lab]
        for b in range(batch):
            for i in range(width):
                p = pos[b][i]
                j = where_pos[b].get(p)
                if j is None:
                    token_bad.setdefault(r, []).append(f"sample {b} index {i}: position {p} is outside 0..{seq - 1}")
                    continue
                owners.setdefault((b, j), []).append(r)
                if lids[b][i] != ids[b][j]:
                    token_bad.setdefault(r, []).append(f"position {p} (sample {b}): token {lids[b][i]}, expected {ids[b][j]}")
                want = labels[b][j + 1] if j + 1 < seq else IGNORE
                got = tgts[b][i]
                if got != want:
                    if got == IGNORE and i == width - 1:
                        boundary_lost.setdefault(r, []).append(p)
                    else:
                        target_bad.setdefault(r, []).append(f"position {p} (sample {b}): target {got}, expected {want}")
                if mask is not None:
                    lmask = loc.get("attention_mask")
                    if lmask is None or lmask[b][i] != mask[b][j]:
                        mask_bad.setdefault(r, []).append(p)
    split_name = f"split {label}"
    if restart:
        starts, at = {}, 0
        for r in sorted(local):
            starts[r] = at
            at += len(local[r]["input_ids"][0]) if local[r]["input_ids"] else 0
        # Every later check would only restate this (tokens, targets and mask at the wrong positions).
        return [_finding(
            "error",
            f"{split_name}: position ids restart at 0 on {format_ranks(restart, world)} instead of carrying global positions",
            "\n".join(f"rank {r}: {len(local[r]['input_ids'][0])} tokens labelled positions {local[r]['position_ids'][0][0]}.."
                      f"{local[r]['position_ids'][0][-1]}; in rank order they start at global position {starts[r]}" for r in restart),
            restart,
            "give each shard the global position of its tokens (position_ids[:, index] of the full batch) before "
            "the split; rotary/learned positions of a shard that restart at 0 encode the wrong place",
        )]
    if no_shift:
        findings.append(_finding(
            "error" if boundary_lost or target_bad else "warning",
            f"{split_name} hands {format_ranks(no_shift, world)} `labels`, not `shift_labels`: the model will shift them "
            "after the split and lose the target of each shard's last token",
            "a split must shift labels over the whole sequence first (shift_labels = labels[:, 1:], -100 at the end)",
            no_shift,
            "shift once before splitting and pass shift_labels to the loss (as transformers' sequence-parallel loss does)",
        ))
    if boundary_lost:
        ranks = sorted(boundary_lost)
        findings.append(_finding(
            "error",
            f"{split_name}: labels were shifted after the split: the target of the last token of each shard is lost "
            f"on {format_ranks(ranks, world)}",
            "\n".join(f"rank {r}: positions {positions_text(sorted(set(ps)))} have target -100, expected the next shard's first token"
                      for r, ps in sorted(boundary_lost.items())),
            ranks,
            "shift labels over the whole sequence before the split (shift_labels), never per shard",
        ))
    for title, bad, fix in (
        ("tokens do not match the unsplit batch at their position ids", token_bad,
         "each rank's input_ids[:, i] must be the full batch's token at position_ids[:, i]"),
        ("targets do not match the unsplit batch", target_bad,
         "shift_labels[:, i] must be labels[:, position + 1] of the full batch (-100 after the last token)"),
    ):
        if bad:
            ranks = sorted(bad)
            findings.append(_finding(
                "error", f"{split_name}: {title} on {format_ranks(ranks, world)}",
                "\n".join(f"rank {r}: {positions_text(v)}" for r, v in sorted(bad.items())), ranks, fix,
            ))
    if mask_bad:
        ranks = sorted(mask_bad)
        findings.append(_finding(
            "error", f"{split_name}: the attention mask is not split like the tokens on {format_ranks(ranks, world)}",
            "\n".join(f"rank {r}: mask differs at positions {positions_text(sorted(set(v)))}" for r, v in sorted(mask_bad.items())),
            ranks, "split attention_mask with the same index as input_ids",
        ))
    missing = [(b, j) for b in range(batch) for j in range(seq) if (b, j) not in owners]
    dup = {k: v for k, v in owners.items() if len(v) > 1}
    if missing:
        findings.append(_finding(
            "error", f"{split_name}: {len(missing)} of {batch * seq} tokens are on no rank",
            f"missing (sample, position): {positions_text(missing)}", [],
            "the shards must cover every position once: check the shard bounds for a sequence length that does not divide",
        ))
    if dup:
        ranks = sorted({r for v in dup.values() for r in v})
        shown = [f"{k}: ranks {v}" for k, v in sorted(dup.items())]
        findings.append(_finding(
            "error", f"{split_name}: {len(dup)} tokens are on more than one rank ({format_ranks(ranks, world)})",
            f"(sample, position): {positions_text(shown)}", ranks,
            "shards must not overlap: every (position, token, target) on exactly one rank",
        ))
    if no_pos and not findings:
        findings.append(_finding(
            "info", f"{split_name} returns no position_ids; checked as contiguous shards in rank order",
            "", no_pos, "return position_ids from the split so the model sees global positions",
        ))
    return findings


def output_shape_problem(got: list[int], local_expected: list[int], full: list[int], world: int) -> str | None:
    """Why an SP output shape is neither the local shard's nor the gathered full one."""
    if got in (local_expected, full):
        return None
    if len(got) == len(local_expected):
        grew = [d for d in range(len(got)) if got[d] != local_expected[d]]
        if len(grew) == 1 and got[grew[0]] == world * local_expected[grew[0]]:
            d = grew[0]
            return (
                f"shape {got}, expected {local_expected} (this rank's shard) or {full} (gathered): dim {d} grew by the "
                f"SP world size {world}: shards were gathered along dim {d} instead of the sequence dim 1"
            )
    return f"shape {got}, expected {local_expected} (this rank's shard) or {full} (gathered)"


def loss_problem(ref: float, sp_values: dict[int, float], valid: dict[int, int], shard_sums: dict[int, float] | None,
                 rtol: float) -> tuple[str, str] | None:
    """(issue, evidence) when the SP loss (mean of the ranks' losses) differs from the reference."""
    ranks = sorted(sp_values)
    sp = sum(sp_values[r] for r in ranks) / len(ranks)
    counts = ", ".join(f"rank {r}: {valid.get(r, '?')}" for r in ranks)
    evidence = f"reference {ref:.6g}, SP {sp:.6g} (mean of rank losses {[round(sp_values[r], 6) for r in ranks]}); valid targets {counts}"
    if not math.isfinite(sp):
        empty = [r for r in ranks if valid.get(r) == 0]
        why = f" - {format_ranks(empty)} had zero valid targets: a per-rank mean divides 0/0" if empty else ""
        return f"the SP loss is {sp} (not finite){why}", evidence
    if math.isfinite(ref) and abs(sp - ref) <= rtol * max(1.0, abs(ref)):
        return None
    if not math.isfinite(ref):
        return None
    if shard_sums and all(valid.get(r, 0) > 0 for r in ranks):
        means = sum(shard_sums[r] / valid[r] for r in ranks) / len(ranks)
        if abs(means - sp) <= rtol * max(1.0, abs(sp)) * 10:
            return (
                f"the SP loss {sp:.6g} is the average of per-rank mean losses, not the full batch's {ref:.6g}: "
                f"ranks hold different numbers of valid targets ({counts})",
                evidence,
            )
    return f"the SP loss {sp:.6g} differs from the loss on the unsplit batch {ref:.6g}", evidence
