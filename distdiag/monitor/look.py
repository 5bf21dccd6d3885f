"""The vector one look all-reduces: what each rank packs, and what the ranks' sum says.

Each rank fills its own slot of K values (the other ranks' slots stay zero) and adds its
share of the sums; after the all_reduce every rank holds every rank's slot and the totals:

    slot  step, (unused), plain-tensor gradient sq, non-finite gradient flag, plain-tensor
          parameter sq, trace (module index, phase, step), hash of the component keys,
          window length | the window's losses (`every`) | the loss components (`max_components`)
    sums  gradient sq per module group (G) | parameter sq (G) | update sq (G)
          | has an update, its step (each / world) | code histogram (`num_codes`)
          | entropy sum, positions, vocab * positions, marginal entropy * positions

`LookReader` turns them into (key, Finding) pairs and the look's record (TrainingMonitor.last).
"""

from __future__ import annotations

import math
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from distdiag.analyze.series import spike_persists, spike_score
from distdiag.monitor import checks
from distdiag.monitor.config import MonitorConfig
from distdiag.monitor.stats import ParamGroups, code_stats, entropy_sum
from distdiag.monitor.trace import PHASES, NonFiniteTracer
from distdiag.report.model import Finding

__all__ = ["HEAD", "Look", "LookReader", "code_histogram", "entropy_sums", "pack_components"]

HEAD = 10
"""Per-rank scalars of a slot before the window's losses."""

_WHERE = {1: "in its forward", 2: "in its backward", 3: "from its own non-finite parameters", 4: "in the data entering it", 5: "in the loss computed from its output", 6: "as a NaN inside its forward (an operation's output, found by the NaN scan)"}


# ------------------------------------------------------------------------ packing
def pack_components(components: dict | None, capacity: int, device: torch.device) -> tuple[list[str], torch.Tensor, float]:
    """(the first `capacity` component names, sorted; their values, NaN-padded; a hash of the names)."""
    names = sorted(components)[:capacity] if components else []
    values = torch.full((capacity,), math.nan, dtype=torch.float64, device=device)
    for i, k in enumerate(names):
        v = components[k]  # type: ignore[index]
        values[i] = v.detach().double().reshape(-1)[0] if isinstance(v, torch.Tensor) else float(v)
    key_hash = float(zlib.crc32("|".join(names).encode()) & 0xFFFFFF) if names else 0.0
    return names, values, key_hash


def code_histogram(codes: torch.Tensor | None, num_codes: int, device: torch.device) -> torch.Tensor:
    """How often each code was chosen (out-of-range indices clamped); zeros without codes."""
    hist = torch.zeros(num_codes, dtype=torch.float64, device=device)
    if codes is not None and num_codes > 0:
        flat = codes.detach().reshape(-1).long()
        hist = torch.bincount(flat.clamp(0, num_codes - 1), minlength=num_codes)[:num_codes].to(device, torch.float64)
    return hist


def entropy_sums(logits: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """(entropy summed over positions, positions, vocab * positions, marginal entropy * positions);
    zeros without logits. Weighted by positions, the ranks' sum gives the mean over positions."""
    ent = torch.zeros(4, dtype=torch.float64, device=device)
    if logits is not None:
        s, n, vocab, marginal = entropy_sum(logits)
        ent[0], ent[1], ent[2], ent[3] = s.to(device), n, float(vocab) * n, marginal.to(device) * n
    return ent


# ------------------------------------------------------------------------ reading
@dataclass
class _Sums:
    """The all-reduced vector cut into its parts."""

    slots: list[list[float]]
    grad: list[float]
    param: list[float]
    update: list[float]
    has_update: float
    update_step: float
    hist: list[float]
    ent: list[float]

    @classmethod
    def unpack(cls, values: list[float], world: int, K: int, G: int, num_codes: int) -> _Sums:
        tail = values[world * K :]
        return cls(
            slots=[values[r * K : (r + 1) * K] for r in range(world)],
            grad=tail[:G], param=tail[G : 2 * G], update=tail[2 * G : 3 * G],
            has_update=tail[3 * G], update_step=tail[3 * G + 1],
            hist=tail[3 * G + 2 : 3 * G + 2 + num_codes], ent=tail[3 * G + 2 + num_codes :],
        )


@dataclass
class Look:
    """What the ranks' sum of one look says."""

    findings: list[tuple[str, Finding]]
    """(dedupe key, finding), in the order the monitor notes them."""
    record: dict[str, Any]
    """The look's values: TrainingMonitor.last, and rank 0's log line."""
    losses: list[float]
    """The loss of each step of the window, averaged over ranks (NaN if any rank's is)."""
    nonfinite: bool
    """A non-finite loss or gradient was seen."""
    traced: bool
    """Some rank's tracer named the module that produced its first non-finite value."""


class LookReader:
    """Reads each look's all-reduced vector into findings and a record; keeps the loss history
    that spikes are measured against and the gradient norm of the previous look."""

    def __init__(self, config: MonitorConfig, groups: ParamGroups, tracer: NonFiniteTracer, ranks: list[int]) -> None:
        self.config = config
        self.groups = groups
        self.tracer = tracer
        self.ranks = ranks
        """The global rank of each slot."""
        self.history: deque[float] = deque(maxlen=config.spike_window)
        self.tail: deque[float] = deque(maxlen=5 * config.spike_window)
        """A longer history, whose highest loss is the batch noise a lone spike must exceed."""
        self.last_grad_norm = math.nan
        self.components = checks.ComponentHistory()
        self._candidate: tuple[int, float, float, float] | None = None
        """A loss above the spike threshold at the last step seen: (step, loss, baseline, threshold)."""

    def read(self, step: int, values: list[float], K: int, G: int, window: list, comp_names: list[str], *, final: bool = False) -> Look:
        """The look at `step`; window: its (step, local loss) pairs, comp_names: the components packed.
        `final`: close()'s look after the last step, whose gradients are no longer that step's
        (stepped, maybe zeroed): the losses are checked, the gradient norms neither judged nor logged."""
        cfg = self.config
        sums = _Sums.unpack(values, len(self.ranks), K, G, cfg.num_codes)
        slots = sums.slots
        per_step = _window_losses(slots, len(window))
        ng = len(self.groups.names)  # the grouped vectors hold the groups, then the same-kind parameters
        unit_sq, sums.grad, sums.param, sums.update = sums.grad[ng:], sums.grad[:ng], sums.param[:ng], sums.update[:ng]
        grad_total = math.sqrt(sum(sums.grad)) if all(math.isfinite(x) for x in sums.grad) else math.nan
        nonfinite = self._nonfinite(slots, window, grad_total, step)
        traces = self._traces(slots, step)
        found = [*nonfinite, *traces, *self._agreement(slots, len(window), step)]
        group_norms = {name: math.sqrt(v) for name, v in zip(self.groups.names, sums.grad, strict=True) if math.isfinite(v)}
        if not final:  # close()'s look: the gradients are no longer the step's
            found += checks.grad_checks(grad_total, self._with_grad(group_norms), cfg, step, first=self.components.looks == 0)
            found += checks.kind_imbalance(self._kinds(unit_sq), cfg, step)
        param_norm = math.sqrt(sum(sums.param)) if all(math.isfinite(x) for x in sums.param) else math.nan
        update_ratio = math.nan
        if sums.has_update > 0.5 and param_norm > 0:
            update_ratio = math.sqrt(sum(sums.update)) / param_norm
            found += checks.update_checks(update_ratio, cfg, int(round(sums.update_step)))
        found += self._spikes(window, per_step, math.nan if final else grad_total, step)
        comps = {k: sum(s[HEAD + cfg.every + i] for s in slots) / len(slots) for i, k in enumerate(comp_names)}
        if comps:
            found += checks.component_checks(comps, cfg, step, self.components)
        code = code_stats(sums.hist) if cfg.num_codes and sum(sums.hist) > 0 else None
        if code is not None:
            found += checks.code_checks(code, cfg.num_codes, cfg, step)
        entropy = None
        if sums.ent and sums.ent[1] > 0:
            entropy, vocab = sums.ent[0] / sums.ent[1], int(round(sums.ent[2] / sums.ent[1]))
            marginal = sums.ent[3] / sums.ent[1]
            found += checks.entropy_checks(entropy, vocab, cfg, step, marginal)
        rec: dict[str, Any] = {"step": step, "loss": per_step[-1] if per_step else math.nan, "param_norm": param_norm}
        if not final:
            self.last_grad_norm = rec["grad_norm"] = grad_total
        if len(self.ranks) > 1 and window:
            rec["loss_by_rank"] = {str(self.ranks[r]): s[HEAD + len(window) - 1] for r, s in enumerate(slots)}
        if not final:
            rec["grad_norm_by_module"] = group_norms
        if sums.has_update > 0.5:
            rec["update_ratio"] = update_ratio
            rec["update_step"] = int(round(sums.update_step))
        if comps:
            rec["loss_components"] = comps
        if code is not None:
            rec["codes"] = code
        if entropy is not None:
            rec["entropy"] = entropy
            rec["entropy_marginal"] = marginal
        return Look(found, rec, per_step, bool(nonfinite), any(not k.startswith("trace:inside:") for k, _ in traces))

    def _nonfinite(self, slots: list[list[float]], window: list, grad_total: float, step: int) -> list[tuple[str, Finding]]:
        """A non-finite loss in the window, non-finite gradients at this look."""
        ranks, out = self.ranks, []
        bad_steps = [(window[j][0], r) for j in range(len(window)) for r, s in enumerate(slots) if not math.isfinite(s[HEAD + j])]
        grad_bad_ranks = [ranks[r] for r, s in enumerate(slots) if s[3] > 0]
        if bad_steps:
            first = min(s for s, _ in bad_steps)
            who = sorted({ranks[r] for s, r in bad_steps if s == first})
            out.append(("nonfinite:loss", Finding("error", f"loss became non-finite at step {first} on rank(s) {', '.join(map(str, who))}",
                                                  f"{len(bad_steps)} non-finite (rank, step) values in the steps {window[0][0]}..{window[-1][0]}", who,
                                                  fix="See the trace finding for the module that produced it; skip updates with non-finite gradients "
                                                  "(GradScaler does) so that the parameters stay finite.", confidence=1.0)))
        if grad_bad_ranks or not math.isfinite(grad_total):
            out.append(("nonfinite:grad", Finding("error", f"gradients are non-finite at step {step} on rank(s) {', '.join(map(str, grad_bad_ranks or ranks))}",
                                                  "the squared gradient norms of the module groups include NaN/Inf", grad_bad_ranks,
                                                  fix="See the trace finding for the module that produced it.", confidence=1.0)))
        return out

    def _traces(self, slots: list[list[float]], step: int) -> list[tuple[str, Finding]]:
        """The origin each rank's tracer found (phase > 0), one finding per rank."""
        out = []
        modules = self.tracer.modules
        for r, s in enumerate(slots):
            idx, phase, tstep = int(s[5]), int(s[6]), int(s[7])
            if phase <= 0:
                continue
            rank = self.ranks[r]
            module = modules[idx][0] if 0 <= idx < len(modules) else f"#{idx}"
            kind = type(modules[idx][1]).__name__ if 0 <= idx < len(modules) else "?"
            # its own key: a NaN replaced inside a module must not stand for a later origin of a NaN loss
            out.append((f"trace:{rank}" if phase != 6 else f"trace:inside:{rank}", Finding(
                "error" if phase != 6 else "warning",
                f"the first non-finite value on rank {rank} appeared {_WHERE[phase]}: module {module!r} ({kind}) at step {tstep}",
                (f"forward/backward hooks armed after the non-finite was seen; phase {PHASES[phase]}" if phase != 6 else
                 "every operation of the forward checked after the NaN scan of a sampled step saw a NaN while the loss stayed "
                 "finite; the operation is named in the distdiag.monitor log of that rank"), [rank],
                fix=("Inspect that module's inputs and weights at that step (log(0), division by a zero norm, fp16 overflow); "
                     "guard it (eps, clamp, compute in float32)." if phase in (1, 2) else
                     "Its parameters were corrupted by an earlier update: skip updates with non-finite gradients, resume from a "
                     "checkpoint and use trace='always' to catch the first occurrence." if phase == 3 else
                "A NaN computed and then replaced (nan_to_num, where, masked_fill) still poisons gradients through that "
                "operation: compute it only where it is defined (clamp the input, mask before the operation)." if phase == 6 else
                     "Check the batch and the code between modules at that step."),
                confidence=0.9 if phase in (1, 2, 6) else 0.7)))
        return out

    def _agreement(self, slots: list[list[float]], n: int, step: int) -> list[tuple[str, Finding]]:
        """Ranks that pass different loss components, and checks.agreement on each rank's row."""
        ranks, out = self.ranks, []
        rows = {ranks[r]: {"step": s[0], "loss": s[HEAD + n - 1] if n else math.nan, "grad_bad": s[3] > 0,
                           "grad_plain": math.sqrt(s[2]) if s[2] >= 0 else math.nan, "param_plain": math.sqrt(s[4]) if s[4] >= 0 else math.nan,
                           "has_plain": self.groups.has_plain} for r, s in enumerate(slots)}
        hashes = {ranks[r]: s[8] for r, s in enumerate(slots)}
        if len(set(hashes.values())) > 1:
            out.append(("agree:components", Finding("error", f"ranks pass different loss components at step {step}", "; ".join(f"rank {r}: key hash {int(h)}" for r, h in hashes.items()),
                                                    sorted(hashes), fix="Pass the same components= keys on every rank.")))
        return out + checks.agreement(rows, self.config, step)

    def _kinds(self, unit_sq: list[float]) -> dict[str, dict[str, float]]:
        """kind -> {parameter name: gradient norm} of the same-kind parameters that have a gradient."""
        out: dict[str, dict[str, float]] = {}
        it = iter(unit_sq)
        for kind, names in self.groups.units.items():
            norms = {n: math.sqrt(v) for n, v in zip(names, it, strict=False) if math.isfinite(v) and v > 0}
            if len(norms) >= 2:
                out[kind] = norms
        return out

    def _with_grad(self, group_norms: dict[str, float]) -> dict[str, float]:
        """The norms of the module groups that have a gradient: frozen ones are not vanishing."""
        groups = self.groups
        with_grad = {groups.names[i] for i, p in zip(groups.index, groups.params, strict=True) if p.grad is not None}
        return {k: v for k, v in group_norms.items() if k in with_grad}

    def _spikes(self, window: list, per_step: list[float], grad_total: float, step: int) -> list[tuple[str, Finding]]:
        """Losses above the spike threshold (analyze.series.spike_score against the history
        before them) that either persist a second step above the same threshold, or exceed
        `spike_factor` times the highest loss of the 5 x spike_window steps before: one batch's noise (a hard batch
        of a small model easily reaches 3-4x the median) does neither. Each finite loss joins
        the history; a candidate at a window's last step is judged at the next look."""
        cfg, history, out = self.config, self.history, []
        for j, (st, _) in enumerate(window):
            x = per_step[j]
            cand, self._candidate = self._candidate, None
            if not math.isfinite(x):
                continue
            if cand is not None and x > cand[3]:
                out.append(self._spike_finding(cand[0], cand[1], cand[2], f"and stayed above {cand[3]:.4g} at step {st} ({x:.4g})", grad_total, step))
            elif len(history) >= min(10, cfg.spike_window):
                spike, base, z = spike_score(list(history), x, cfg.spike_factor)
                if spike and spike_persists(list(self.tail), [x], cfg.spike_factor):
                    out.append(self._spike_finding(st, x, base, f"{x / max(self.tail):.1f}x the highest of the {len(self.tail)} steps before ({max(self.tail):.4g})", grad_total, step))
                elif spike:
                    self._candidate = (st, x, base, base + max((cfg.spike_factor - 1) * abs(base), 6.0 * (x - base) / z))
            history.append(x)
            self.tail.append(x)
        return out

    def _spike_finding(self, st: int, x: float, base: float, why: str, grad_total: float, step: int) -> tuple[str, Finding]:
        gn = "" if math.isnan(grad_total) else f"; gradient norm {grad_total:.4g} at step {step} (last look {self.last_grad_norm:.4g})"
        return (f"spike:{st}", Finding("warning", f"loss spiked at step {st} to {x:.4g} ({x / base:.1f}x the median {base:.4g} of the {len(self.history)} steps before) {why}",
                                       f"loss averaged over {len(self.ranks)} rank(s){gn}; a spike must persist a second step or exceed "
                                       f"{self.config.spike_factor:g}x the highest loss of the {5 * self.config.spike_window} steps before: one batch's noise does neither",
                                       fix="Check the batch at that step; clip gradients if the gradient norm jumped too.", confidence=0.8))


def _window_losses(slots: list[list[float]], n: int) -> list[float]:
    """The loss of each of the window's n steps, averaged over the ranks' slots."""
    per_step = []
    for j in range(n):
        vals = [s[HEAD + j] for s in slots]
        per_step.append(sum(vals) / len(vals))
    return per_step
