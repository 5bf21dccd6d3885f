"""Pure checks of sequence-parallel splits and results (no collectives; unit-testable).

`analyze_split` compares what every rank got from a split with the unsplit batch, as
(global position, input token, target) triples; `output_shape_problem` explains an SP
output of the wrong shape; `loss_problem` explains an SP loss that differs from the
reference, using the per-rank valid-token counts.
"""

from __future__ import annotations

import math
from collections import Counter
from itertools import accumulate, chain
from operator import itemgetter
from typing import Any

from distdiag.probes.causes import ProbeCause
from distdiag.report.model import Finding
from distdiag.report.render import format_ranks

__all__ = ["analyze_split", "output_shape_problem", "loss_problem", "positions_text", "IGNORE"]

IGNORE = -100
_SHOW = 8


def positions_text(items: list[Any]) -> str:
    shown = ", ".join(str(i) for i in items[:_SHOW])
    return shown + (f", ... ({len(items)} in all)" if len(items) > _SHOW else "")


def _finding(severity: str, issue: str, evidence: str, ranks: list[int], fix: str, cause: ProbeCause | None = None) -> Finding:
    return Finding(severity=severity, issue=issue, evidence=evidence, ranks=ranks, fix=fix, confidence=0.95, cause=cause or "")


def analyze_split(label: str, full: dict[str, Any], local: dict[int, dict[str, Any]], world: int) -> list[Finding]:
    """Findings about one split: `full` and each rank's `local` hold nested lists [B][S]."""
    walk = _SplitWalk(full, local)
    split_name = f"split {label}"
    if walk.restart:
        # Every later check would only restate this (tokens, targets and mask at the wrong positions).
        return [_restarted_positions(split_name, local, walk.restart, world)]
    findings: list[Finding] = []
    findings += _labels_not_shifted(split_name, walk, world)
    findings += _boundary_targets_lost(split_name, walk, world)
    findings += _tokens_and_targets_wrong(split_name, walk, world)
    findings += _mask_not_split(split_name, walk, world)
    findings += _tokens_lost(split_name, walk)
    findings += _tokens_duplicated(split_name, walk, world)
    if walk.no_pos and not findings:
        findings.append(_finding(
            "info", f"{split_name} returns no position_ids; checked as contiguous shards in rank order",
            "", walk.no_pos, "return position_ids from the split so the model sees global positions",
        ))
    return findings


class _SplitWalk:
    """Every rank's (global position, input token, target) triples set against the unsplit batch.

    Collects, per rank, what disagrees (tokens, targets, lost boundary targets, mask), which
    rank holds each (sample, position), and the ranks whose position ids restart at 0.

    The ranks' rows that match the unsplit batch everywhere (every row of a healthy job) are
    judged together, sample by sample, with a few list comparisons over all ranks; when one
    differs somewhere, each rank's rows are judged apart and a row that differs is walked
    token by token for the messages: at 16k ranks the built-in batch has 4 x 2 x 32k tokens
    in rows of 2, and the walk by token was most of the check's consolidation (issue 21).
    """

    def __init__(self, full: dict[str, Any], local: dict[int, dict[str, Any]]) -> None:
        self.ids, self.labels = full["input_ids"], full["labels"]
        self.batch, self.seq = len(self.ids), len(self.ids[0])
        self.mask = full.get("attention_mask")
        full_pos = full.get("position_ids") or [list(range(self.seq)) for _ in range(self.batch)]
        self.where_pos = {b: {p: i for i, p in enumerate(full_pos[b])} for b in range(self.batch)}
        # Each full row's target at each index (None, every row walked by token: rows of other lengths).
        even = all(len(row) == self.seq for rows in (self.ids, self.labels) for row in rows)
        self.want_targets = [row[1:] + [IGNORE] for row in self.labels] if even else None
        self.visits: list[tuple[int, int, list[int]]] = []  # (rank, sample, indices into the full row it holds)
        self.together: tuple[list[int], list[int], list[list[int]]] | None = None  # (ranks, widths, indices per sample)
        self._counts: list[Counter[int]] | None = None
        self.token_bad: dict[int, list[str]] = {}
        self.target_bad: dict[int, list[str]] = {}
        self.boundary_lost: dict[int, list[int]] = {}
        self.mask_bad: dict[int, list[int]] = {}
        ranks = sorted(local)
        locs = [local[r] for r in ranks]
        shifted = [loc.get("shift_labels") for loc in locs]
        given = [loc.get("position_ids") for loc in locs]
        self.no_shift = [r for r, t in zip(ranks, shifted, strict=True) if t is None]
        self.no_pos = [r for r, g in zip(ranks, given, strict=True) if g is None]
        # Each shard starts where the one before it in rank order ended (positions when it gives none).
        widths = [len(loc["input_ids"][0]) if loc["input_ids"] else 0 for loc in locs]
        offsets = [0, *accumulate(widths)][:-1]
        poss = [g or [list(range(o, o + w)) for _ in range(self.batch)] for g, o, w in zip(given, offsets, widths, strict=True)]
        # A shard's first row starting at 0 is needed for a restart (the cheap test first).
        self.restart = [r for r, g, pos, w in zip(ranks, given, poss, widths, strict=True)
                        if r > 0 and g is not None and w and pos[0] and pos[0][0] == 0 and all(row and row[0] == 0 for row in pos)]
        tgts = [t if t is not None else self._targets(loc, w) for t, loc, w in zip(shifted, locs, widths, strict=True)]
        shards = list(zip(ranks, locs, poss, tgts, widths, strict=True))
        if not self._all_match(shards):
            for shard in shards:
                self._rank(*shard)

    def _rank(self, r: int, loc: dict[str, Any], pos: list[list[int]], tgts: list[list[int]], width: int) -> None:
        """Walk rank r's shard: a row that matches at once, else token by token."""
        for b in range(self.batch):
            if not self._row_matches(loc, b, pos, tgts, width, r):
                for i in range(width):
                    self._token(r, loc, b, i, pos[b][i], tgts, width)

    def _all_match(self, shards: list[tuple[int, dict[str, Any], list[list[int]], list[list[int]], int]]) -> bool:
        """Whether every rank's every row holds the full batch's tokens, targets and mask at its
        positions, judged a sample at a time over all ranks (then noted as visited together)."""
        if self.want_targets is None or not shards:
            return False
        ranks, locs, poss, tgts, widths = (list(x) for x in zip(*shards, strict=True))
        indices = []
        try:
            for b in range(self.batch):
                rows = [[loc["input_ids"][b] for loc in locs], [t[b] for t in tgts]]
                want = [self.ids[b], self.want_targets[b]]
                if self.mask is not None:
                    rows.append([loc["attention_mask"][b] for loc in locs])
                    want.append(self.mask[b])
                pos_rows = [pos[b] for pos in poss]
                if any(list(map(len, held)) != widths for held in [*rows, pos_rows]):
                    return False  # ragged rows (or positions beyond the shard): judged rank by rank
                js: list[Any] = list(map(self.where_pos[b].get, chain.from_iterable(pos_rows)))  # None: not in the row
                if None in js or len(js) < 2:
                    return False
                at = itemgetter(*js)  # the full row's values at the shards' positions, in C
                if any(at(w) != tuple(chain.from_iterable(held)) for w, held in zip(want, rows, strict=True)):
                    return False
                indices.append(js)
        except (IndexError, TypeError, KeyError):
            return False  # the walk by token meets the same and says what it says of it
        self.together = (ranks, widths, indices)
        return True

    def _row_matches(self, loc: dict[str, Any], b: int, pos: list[list[int]], tgts: list[list[int]], width: int, r: int) -> bool:
        """Whether rank r's row b holds, at each of its positions, the full batch's token, target
        and mask (then noted as visited); False: walk it token by token."""
        if self.want_targets is None:
            return False
        try:
            where = self.where_pos[b]
            js: list[Any] = [where.get(p) for p in pos[b][:width]]  # None: not in the row
            if len(js) != width or None in js:
                return False
            ids, lmask = loc["input_ids"][b], loc.get("attention_mask")
            if len(ids) != width or [self.ids[b][j] for j in js] != ids:
                return False
            if len(tgts[b]) != width or [self.want_targets[b][j] for j in js] != tgts[b]:
                return False
            if self.mask is not None and (lmask is None or len(lmask[b]) != width or [self.mask[b][j] for j in js] != lmask[b]):
                return False
        except (IndexError, TypeError, KeyError):
            return False  # the walk by token meets the same and says what it says of it
        self.visits.append((r, b, js))
        return True

    def _targets(self, loc: dict[str, Any], width: int) -> list[list[int]]:
        """The shard's targets: its shift_labels, else what a model that shifts its own labels would train on."""
        if loc.get("shift_labels") is not None:
            return loc["shift_labels"]
        lab = loc.get("labels") or [[IGNORE] * width for _ in range(self.batch)]
        return [row[1:] + [IGNORE] for row in lab]

    def _token(self, r: int, loc: dict[str, Any], b: int, i: int, p: int, tgts: list[list[int]], width: int) -> None:
        """Check the token at local index i of sample b (global position p) of rank r."""
        j = self.where_pos[b].get(p)
        if j is None:
            self.token_bad.setdefault(r, []).append(f"sample {b} index {i}: position {p} is outside 0..{self.seq - 1}")
            return
        self.visits.append((r, b, [j]))
        if loc["input_ids"][b][i] != self.ids[b][j]:
            self.token_bad.setdefault(r, []).append(f"position {p} (sample {b}): token {loc['input_ids'][b][i]}, expected {self.ids[b][j]}")
        want = self.labels[b][j + 1] if j + 1 < self.seq else IGNORE
        got = tgts[b][i]
        if got != want:
            if got == IGNORE and i == width - 1:
                self.boundary_lost.setdefault(r, []).append(p)
            else:
                self.target_bad.setdefault(r, []).append(f"position {p} (sample {b}): target {got}, expected {want}")
        if self.mask is not None:
            lmask = loc.get("attention_mask")
            if lmask is None or lmask[b][i] != self.mask[b][j]:
                self.mask_bad.setdefault(r, []).append(p)

    def _visited(self) -> list[tuple[int, int, list[int]]]:
        """(rank, sample, indices into the full row) of every row walked, in rank order."""
        if self.together is None:
            return self.visits
        ranks, widths, indices = self.together
        out, start = [], 0
        for r, width in zip(ranks, widths, strict=True):
            out += [(r, b, indices[b][start : start + width]) for b in range(self.batch)]
            start += width
        return out

    def _holders(self) -> list[Counter[int]]:
        """How many times some rank holds each (sample, position) (counted once, on first ask)."""
        if self._counts is None:
            counts: list[Counter[int]] = [Counter() for _ in range(self.batch)]
            visits = [(None, b, js) for b, js in enumerate(self.together[2])] if self.together else self.visits
            for _r, b, js in visits:
                counts[b].update(js)
            self._counts = counts
        return self._counts

    def missing(self) -> list[tuple[int, int]]:
        """(sample, position) pairs no rank holds, in order."""
        counts = self._holders()
        return [(b, j) for b in range(self.batch) for j in range(self.seq) if j not in counts[b]]

    def duplicated(self) -> dict[tuple[int, int], list[int]]:
        """(sample, position) pairs held more than once -> the ranks holding them, in walk order."""
        counts = self._holders()
        dup: dict[tuple[int, int], list[int]] = {}
        if all(c.total() == len(c) for c in counts):
            return dup  # every position held once at most
        for r, b, js in self._visited():
            for j in js:
                if counts[b][j] > 1:
                    dup.setdefault((b, j), []).append(r)
        return dup


def _restarted_positions(split_name: str, local: dict[int, dict[str, Any]], restart: list[int], world: int) -> Finding:
    """Position ids that restart at 0 on later ranks instead of carrying global positions."""
    starts, at = {}, 0
    for r in sorted(local):
        starts[r] = at
        at += len(local[r]["input_ids"][0]) if local[r]["input_ids"] else 0
    return _finding(
        "error",
        f"{split_name}: position ids restart at 0 on {format_ranks(restart, world)} instead of carrying global positions",
        "\n".join(f"rank {r}: {len(local[r]['input_ids'][0])} tokens labelled positions {local[r]['position_ids'][0][0]}.."
                  f"{local[r]['position_ids'][0][-1]}; in rank order they start at global position {starts[r]}" for r in restart),
        restart,
        "give each shard the global position of its tokens (position_ids[:, index] of the full batch) before "
        "the split; rotary/learned positions of a shard that restart at 0 encode the wrong place",
        ProbeCause.SP_POSITIONS_RESTART,
    )


def _labels_not_shifted(split_name: str, walk: _SplitWalk, world: int) -> list[Finding]:
    """Ranks handed `labels` rather than `shift_labels` (an error once a target was lost or wrong)."""
    if not walk.no_shift:
        return []
    return [_finding(
        "error" if walk.boundary_lost or walk.target_bad else "warning",
        f"{split_name} hands {format_ranks(walk.no_shift, world)} `labels`, not `shift_labels`: the model will shift them "
        "after the split and lose the target of each shard's last token",
        "a split must shift labels over the whole sequence first (shift_labels = labels[:, 1:], -100 at the end)",
        walk.no_shift,
        "shift once before splitting and pass shift_labels to the loss (as transformers' sequence-parallel loss does)",
        ProbeCause.LABELS_SHIFTED_AFTER_SPLIT,
    )]


def _boundary_targets_lost(split_name: str, walk: _SplitWalk, world: int) -> list[Finding]:
    """Labels shifted per shard: each shard's last token lost its target (the next shard's first token)."""
    if not walk.boundary_lost:
        return []
    ranks = sorted(walk.boundary_lost)
    return [_finding(
        "error",
        f"{split_name}: labels were shifted after the split: the target of the last token of each shard is lost "
        f"on {format_ranks(ranks, world)}",
        "\n".join(f"rank {r}: positions {positions_text(sorted(set(ps)))} have target -100, expected the next shard's first token"
                  for r, ps in sorted(walk.boundary_lost.items())),
        ranks,
        "shift labels over the whole sequence before the split (shift_labels), never per shard",
        ProbeCause.LABELS_SHIFTED_AFTER_SPLIT,
    )]


def _tokens_and_targets_wrong(split_name: str, walk: _SplitWalk, world: int) -> list[Finding]:
    """Tokens, then targets, that differ from the unsplit batch's at their global position."""
    findings = []
    for title, bad, fix, cause in (
        ("tokens do not match the unsplit batch at their position ids", walk.token_bad,
         "each rank's input_ids[:, i] must be the full batch's token at position_ids[:, i]", ProbeCause.SPLIT_WRONG_TOKENS),
        ("targets do not match the unsplit batch", walk.target_bad,
         "shift_labels[:, i] must be labels[:, position + 1] of the full batch (-100 after the last token)",
         ProbeCause.SPLIT_WRONG_TARGETS),
    ):
        if bad:
            ranks = sorted(bad)
            findings.append(_finding(
                "error", f"{split_name}: {title} on {format_ranks(ranks, world)}",
                "\n".join(f"rank {r}: {positions_text(v)}" for r, v in sorted(bad.items())), ranks, fix, cause,
            ))
    return findings


def _mask_not_split(split_name: str, walk: _SplitWalk, world: int) -> list[Finding]:
    """An attention mask that does not follow the tokens."""
    if not walk.mask_bad:
        return []
    ranks = sorted(walk.mask_bad)
    return [_finding(
        "error", f"{split_name}: the attention mask is not split like the tokens on {format_ranks(ranks, world)}",
        "\n".join(f"rank {r}: mask differs at positions {positions_text(sorted(set(v)))}" for r, v in sorted(walk.mask_bad.items())),
        ranks, "split attention_mask with the same index as input_ids", ProbeCause.SP_MASK_NOT_SPLIT,
    )]


def _tokens_lost(split_name: str, walk: _SplitWalk) -> list[Finding]:
    """(sample, position) pairs no rank holds."""
    missing = walk.missing()
    if not missing:
        return []
    return [_finding(
        "error", f"{split_name}: {len(missing)} of {walk.batch * walk.seq} tokens are on no rank",
        f"missing (sample, position): {positions_text(missing)}", [],
        "the shards must cover every position once: check the shard bounds for a sequence length that does not divide",
        ProbeCause.SPLIT_DROPS_TOKENS,
    )]


def _tokens_duplicated(split_name: str, walk: _SplitWalk, world: int) -> list[Finding]:
    """(sample, position) pairs more than one rank holds."""
    dup = walk.duplicated()
    if not dup:
        return []
    ranks = sorted({r for v in dup.values() for r in v})
    shown = [f"{k}: ranks {v}" for k, v in sorted(dup.items())]
    return [_finding(
        "error", f"{split_name}: {len(dup)} tokens are on more than one rank ({format_ranks(ranks, world)})",
        f"(sample, position): {positions_text(shown)}", ranks,
        "shards must not overlap: every (position, token, target) on exactly one rank", ProbeCause.SPLIT_DUPLICATES_TOKENS,
    )]


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
    if math.isfinite(sp) and (not math.isfinite(ref) or abs(sp - ref) <= rtol * max(1.0, abs(ref))):
        return None  # equal, or no reference to compare with: decided before the evidence (a line per rank)
    counts = ", ".join(f"rank {r}: {valid.get(r, '?')}" for r in ranks)
    evidence = f"reference {ref:.6g}, SP {sp:.6g} (mean of rank losses {[round(sp_values[r], 6) for r in ranks]}); valid targets {counts}"
    if not math.isfinite(sp):
        empty = [r for r in ranks if valid.get(r) == 0]
        why = f" - {format_ranks(empty)} had zero valid targets: a per-rank mean divides 0/0" if empty else ""
        return f"the SP loss is {sp} (not finite){why}", evidence
    if shard_sums and all(valid.get(r, 0) > 0 for r in ranks):
        means = sum(shard_sums[r] / valid[r] for r in ranks) / len(ranks)
        if abs(means - sp) <= rtol * max(1.0, abs(sp)) * 10:
            return (
                f"the SP loss {sp:.6g} is the average of per-rank mean losses, not the full batch's {ref:.6g}: "
                f"ranks hold different numbers of valid targets ({counts})",
                evidence,
            )
    return f"the SP loss {sp:.6g} differs from the loss on the unsplit batch {ref:.6g}", evidence
