"""distdiag.TrainingMonitor: training-health evidence gathered in the loop at a small cost.

    monitor = TrainingMonitor(model, optimizer=opt, every=10, log="metrics.jsonl")
    for step, batch in enumerate(loader):
        loss = loss_fn(model(batch))
        loss.backward()
        monitor.after_backward(loss, step)       # every rank, every step
        opt.step(); opt.zero_grad()
    findings = monitor.close()

Collectives: at every `every`-th step, after_backward issues ONE all_reduce of a small
float64 vector (a few scalars per rank, the grouped norms, the code histogram) on `group`
(default: the world). It must therefore be called on every rank of the group, at the same
steps, in the same order relative to the job's other collectives. Other steps issue no
collective and do not synchronise the device: the loss is kept as a device scalar and read
at the next look.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import zlib
from collections import deque
from pathlib import Path
from typing import Any

import torch

from distdiag.analyze.series import spike_score
from distdiag.monitor import checks
from distdiag.monitor.config import MonitorConfig
from distdiag.monitor.stats import ParamGroups, code_stats, entropy_sum, param_counts
from distdiag.monitor.trace import PHASES, NonFiniteTracer
from distdiag.report.model import Finding, ProbeResult

__all__ = ["TrainingMonitor"]

log = logging.getLogger("distdiag.monitor")

METRICS_SCHEMA = "distdiag.metrics/1"
_HEAD = 10  # per-rank scalars before the loss window (see _look)


class TrainingMonitor:
    """Loss, gradient norms per module group, non-finite origins, spikes, update ratios,
    cross-rank agreement, loss components, code usage and output entropy.

    Findings (distdiag.report.Finding) are kept once each with the first step they were seen;
    `findings` lists them, `result()` wraps them as a ProbeResult named "monitor", and rank 0
    appends them to the JSONL log as `{"kind": "finding", ...}` lines (read by distdiag analyze).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        every: int | None = None,
        log: str | Path | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        group: Any = None,
        tensorboard: str | Path | None = None,
        config: MonitorConfig | None = None,
        **overrides: Any,
    ) -> None:
        import torch.distributed as dist

        from distdiag.check.config import dataclass_from_dict

        base = config or MonitorConfig()
        if every is not None:
            overrides["every"] = every
        # keywords override the config's fields only when given; unknown ones name monitor.KEY
        self.config = dataclass_from_dict(MonitorConfig, {**dataclasses.asdict(base), **overrides}, "monitor") if overrides else base
        cfg = self.config
        self.model = model
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed:
            self.world = dist.get_world_size(group)
            self.global_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world))
            self.rank = dist.get_rank(group)
        else:
            self.world, self.global_ranks, self.rank = 1, [0], 0
        # DDP's wrapper adds a "module." prefix to every name: report the user's names
        inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        self.groups = ParamGroups(inner, cfg.depth, self.world)
        self.tracer = NonFiniteTracer(inner)
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._history: deque[float] = deque(maxlen=cfg.spike_window)
        self._found: dict[str, dict] = {}
        self._trace_until = -1
        self._trace_local: tuple[int, int, int] | None = None
        self._trace_done = False
        self._counter = 0
        self._snapshot_next = False
        self._before: list[torch.Tensor] | None = None
        self._update: tuple[int, torch.Tensor] | None = None
        self._components: list[str] | None = None
        self._hooks: list[Any] = []
        self._last_grad_norm = math.nan
        self.last: dict[str, Any] = {}
        """The values of the last look (what rank 0 logged)."""
        if optimizer is not None:
            self._hooks.append(optimizer.register_step_pre_hook(self._opt_pre))
            self._hooks.append(optimizer.register_step_post_hook(self._opt_post))
        self._log = None
        self._tb = None
        if self.rank == 0 and log is not None:
            path = Path(log)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the monitor
        if self.rank == 0 and tensorboard is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(tensorboard))
            except ImportError:
                log.warning("tensorboard is not installed: metrics go to the JSONL log only")
        counts = param_counts(inner)
        self._write({"kind": "header", "schema": METRICS_SCHEMA, "every": cfg.every, "world_size": self.world, "params": counts})
        self._param_findings(counts)
        if cfg.trace == "always":
            self.tracer.arm(0)

    # ------------------------------------------------------------------ public
    def after_backward(
        self,
        loss: torch.Tensor | float,
        step: int | None = None,
        *,
        components: dict[str, torch.Tensor | float] | None = None,
        codes: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
    ) -> None:
        """Call after loss.backward() and before optimizer.step(), on every rank, every step.

        components: the loss terms ({"ce": .., "aux": ..}); codes: chosen indices of a codebook
        or of MoE experts (needs num_codes=); logits: a language model's output, for its entropy.
        They are read only at looks (every `every` steps); pass them at least then.
        """
        step = self._counter if step is None else int(step)
        self._counter = step + 1
        value = loss.detach().reshape(-1)[0].double() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss), dtype=torch.float64)
        self._pending.append((step, value))
        if self.tracer.armed:
            origin = self.tracer.collect()
            if origin is not None and self._trace_local is None:
                self._trace_local = (origin.module_index, origin.phase, origin.step)
        if step % self.config.every == 0:
            self._look(step, components, codes, logits)
        self._rearm(step)

    @property
    def findings(self) -> list[Finding]:
        out = []
        for entry in self._found.values():
            f = entry["finding"]
            if entry["count"] > 1:
                # replace keeps every field (drain included), only the evidence grows
                f = dataclasses.replace(f, evidence=(f.evidence + "; " if f.evidence else "") + f"seen at {entry['count']} looks, last at step {entry['last']}")
            out.append(f)
        return out

    def result(self) -> ProbeResult:
        return ProbeResult.from_findings("monitor", self.findings, metrics={k: v for k, v in self.last.items() if isinstance(v, int | float)})

    def close(self) -> list[Finding]:
        """Remove every hook and close the log; returns the findings."""
        self.tracer.disarm()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        return self.findings

    def __enter__(self) -> TrainingMonitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------- internals
    def _opt_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._snapshot_next:
            self._before = self.groups.snapshot()

    def _opt_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._before is not None:
            self._update = (self._snapshot_step, self.groups.update_sq(self._before))
            self._before = None
        self._snapshot_next = False

    def _rearm(self, step: int) -> None:
        """Arm the tracer for the next step, or disarm it: hooks cost a sync per module."""
        cfg = self.config
        if cfg.trace == "always":
            self.tracer.arm(step + 1)
        elif cfg.trace == "auto" and step < self._trace_until and self._trace_local is None and not self._trace_done:
            self.tracer.arm(step + 1)
        elif self.tracer.armed:
            self.tracer.disarm()

    def _write(self, record: dict) -> None:
        if self._log is not None:
            self._log.write(json.dumps(record, default=float) + "\n")

    def _note(self, key: str, finding: Finding, step: int) -> None:
        entry = self._found.get(key)
        if entry is not None:
            entry["count"] += 1
            entry["last"] = step
            return
        self._found[key] = {"finding": finding, "count": 1, "first": step, "last": step}
        if self.rank == 0:
            getattr(log, "error" if finding.severity in ("error", "critical") else "warning" if finding.severity == "warning" else "info")(
                "step %d: %s", step, finding.issue
            )
            self._write({"kind": "finding", "step": step, "finding": finding.to_dict()})

    def _param_findings(self, counts: list[dict]) -> None:
        total = sum(r["params"] for r in counts)
        table = ", ".join(f"{r['module']} {r['params']:,} ({r['share']:.0%})" for r in counts[:8])
        self._note("params:table", Finding("info", f"{total:,} parameters; by top-level module: {table}", confidence=1.0), 0)
        emb = [r for r in counts if r["embedding"] and r["share"] >= 0.5]
        if emb:
            r = emb[0]
            self._note("params:embedding", Finding(
                "warning", f"embeddings hold most of the parameters: {r['module']} has {r['params']:,} of {total:,} ({r['share']:.0%})",
                fix="The model's capacity sits in a lookup table: consider tying input/output embeddings, a smaller vocabulary, or a deeper body.",
                confidence=0.7), 0)

    def _look(self, step: int, components: dict | None, codes: torch.Tensor | None, logits: torch.Tensor | None) -> None:
        import torch.distributed as dist

        cfg, groups, dev = self.config, self.groups, self.groups.device
        window = self._pending[-cfg.every :]
        self._pending.clear()
        G = len(groups.names)
        grad_sq, grad_plain, grad_bad = groups.grads()
        par_sq, par_plain, _ = groups.values()
        comp_names = sorted(components)[: cfg.max_components] if components else []
        comp_vals = torch.full((cfg.max_components,), math.nan, dtype=torch.float64, device=dev)
        for i, k in enumerate(comp_names):
            v = components[k]  # type: ignore[index]
            comp_vals[i] = v.detach().double().reshape(-1)[0] if isinstance(v, torch.Tensor) else float(v)
        comp_hash = float(zlib.crc32("|".join(comp_names).encode()) & 0xFFFFFF) if comp_names else 0.0
        losses = torch.full((cfg.every,), math.nan, dtype=torch.float64, device=dev)
        if window:
            losses[: len(window)] = torch.stack([v.to(dev) for _, v in window])
        trace = self._trace_local or (-1, 0, -1)
        head = torch.tensor([step, 0.0, 0.0, 0.0, 0.0, *trace, comp_hash, len(window)], dtype=torch.float64, device=dev)
        head[2], head[3], head[4] = grad_plain, grad_bad, par_plain
        slot = torch.cat([head, losses, comp_vals])
        K = slot.numel()
        upd_step, upd_sq = self._update if self._update is not None else (-1, torch.zeros(G, dtype=torch.float64, device=dev))
        hist = torch.zeros(cfg.num_codes, dtype=torch.float64, device=dev)
        if codes is not None and cfg.num_codes > 0:
            flat = codes.detach().reshape(-1).long()
            hist = torch.bincount(flat.clamp(0, cfg.num_codes - 1), minlength=cfg.num_codes)[: cfg.num_codes].to(dev, torch.float64)
        ent = torch.zeros(3, dtype=torch.float64, device=dev)
        if logits is not None:
            s, n, vocab = entropy_sum(logits)
            ent[0], ent[1], ent[2] = s.to(dev), n, float(vocab) * n
        has_upd = torch.tensor([1.0 if self._update is not None else 0.0, float(upd_step)], dtype=torch.float64, device=dev) / self.world
        vec = torch.zeros(self.world * K, dtype=torch.float64, device=dev)
        vec[self.rank * K : (self.rank + 1) * K] = slot
        vec = torch.cat([vec, grad_sq, par_sq, upd_sq.to(dev), has_upd, hist, ent])
        if self.distributed and self.world > 1:
            dist.all_reduce(vec, group=self.group)
        values = vec.tolist()  # the one device sync of a look
        self._update = None
        if codes is not None and cfg.num_codes == 0:
            log.warning("codes= passed without num_codes=: code statistics are off")
        self._decode(step, values, K, G, window, comp_names)
        self._snapshot_next, self._snapshot_step = True, step

    def _decode(self, step: int, values: list[float], K: int, G: int, window: list, comp_names: list[str]) -> None:
        cfg = self.config
        slots = [values[r * K : (r + 1) * K] for r in range(self.world)]
        tail = values[self.world * K :]
        grad_g, par_g, upd_g = tail[:G], tail[G : 2 * G], tail[2 * G : 3 * G]
        has_upd, upd_step = tail[3 * G], tail[3 * G + 1]
        hist = tail[3 * G + 2 : 3 * G + 2 + cfg.num_codes]
        ent = tail[3 * G + 2 + cfg.num_codes :]
        ranks = self.global_ranks
        # the loss of each step of the window, averaged over ranks (NaN if any rank's is)
        n = len(window)
        per_step = []
        for j in range(n):
            vals = [s[_HEAD + j] for s in slots]
            per_step.append(sum(vals) / len(vals))
        bad_steps = [(window[j][0], r) for j in range(n) for r, s in enumerate(slots) if not math.isfinite(s[_HEAD + j])]
        grad_total = math.sqrt(sum(grad_g)) if all(math.isfinite(x) for x in grad_g) else math.nan
        grad_bad_ranks = [ranks[r] for r, s in enumerate(slots) if s[3] > 0]
        if bad_steps:
            first = min(s for s, _ in bad_steps)
            who = sorted({ranks[r] for s, r in bad_steps if s == first})
            self._note("nonfinite:loss", Finding("error", f"loss became non-finite at step {first} on rank(s) {', '.join(map(str, who))}",
                                                 f"{len(bad_steps)} non-finite (rank, step) values in the steps {window[0][0]}..{window[-1][0]}", who,
                                                 fix="See the trace finding for the module that produced it; skip updates with non-finite gradients "
                                                 "(GradScaler does) so that the parameters stay finite.", confidence=1.0), step)
        if grad_bad_ranks or not math.isfinite(grad_total):
            self._note("nonfinite:grad", Finding("error", f"gradients are non-finite at step {step} on rank(s) {', '.join(map(str, grad_bad_ranks or ranks))}",
                                                 "the squared gradient norms of the module groups include NaN/Inf", grad_bad_ranks,
                                                 fix="See the trace finding for the module that produced it.", confidence=1.0), step)
        if (bad_steps or grad_bad_ranks or not math.isfinite(grad_total)) and cfg.trace == "auto" and self._trace_local is None:
            self._trace_until = step + cfg.trace_steps
        for r, s in enumerate(slots):
            idx, phase, tstep = int(s[5]), int(s[6]), int(s[7])
            if phase > 0:
                self._trace_done, self._trace_until = True, -1
                module = self.tracer.modules[idx][0] if 0 <= idx < len(self.tracer.modules) else f"#{idx}"
                kind = type(self.tracer.modules[idx][1]).__name__ if 0 <= idx < len(self.tracer.modules) else "?"
                where = {1: "in its forward", 2: "in its backward", 3: "from its own non-finite parameters", 4: "in the data entering it", 5: "in the loss computed from its output"}[phase]
                self._note(f"trace:{ranks[r]}", Finding(
                    "error",
                    f"the first non-finite value on rank {ranks[r]} appeared {where}: module {module!r} ({kind}) at step {tstep}",
                    f"forward/backward hooks armed after the non-finite was seen; phase {PHASES[phase]}", [ranks[r]],
                    fix=("Inspect that module's inputs and weights at that step (log(0), division by a zero norm, fp16 overflow); "
                         "guard it (eps, clamp, compute in float32)." if phase in (1, 2) else
                         "Its parameters were corrupted by an earlier update: skip updates with non-finite gradients, resume from a "
                         "checkpoint and use trace='always' to catch the first occurrence." if phase == 3 else
                         "Check the batch and the code between modules at that step."),
                    confidence=0.9 if phase in (1, 2) else 0.7), step)
        rows = {ranks[r]: {"step": s[0], "loss": s[_HEAD + n - 1] if n else math.nan, "grad_bad": s[3] > 0,
                           "grad_plain": math.sqrt(s[2]) if s[2] >= 0 else math.nan, "param_plain": math.sqrt(s[4]) if s[4] >= 0 else math.nan,
                           "has_plain": self.groups.has_plain} for r, s in enumerate(slots)}
        hashes = {ranks[r]: s[8] for r, s in enumerate(slots)}
        if len(set(hashes.values())) > 1:
            self._note("agree:components", Finding("error", f"ranks pass different loss components at step {step}", "; ".join(f"rank {r}: key hash {int(h)}" for r, h in hashes.items()),
                                                   sorted(hashes), fix="Pass the same components= keys on every rank."), step)
        for key, f in checks.agreement(rows, cfg, step):
            self._note(key, f, step)
        group_norms = {name: math.sqrt(v) for name, v in zip(self.groups.names, grad_g, strict=True) if math.isfinite(v)}
        # frozen module groups (no gradient at all) are not vanishing
        with_grad = {self.groups.names[i] for i, p in zip(self.groups.index, self.groups.params, strict=True) if p.grad is not None}
        for key, f in checks.grad_checks(grad_total, {k: v for k, v in group_norms.items() if k in with_grad}, cfg, step):
            self._note(key, f, step)
        param_norm = math.sqrt(sum(par_g)) if all(math.isfinite(x) for x in par_g) else math.nan
        update_ratio = math.nan
        if has_upd > 0.5 and param_norm > 0:
            update_ratio = math.sqrt(sum(upd_g)) / param_norm
            for key, f in checks.update_checks(update_ratio, cfg, int(round(upd_step))):
                self._note(key, f, step)
        for j, (st, _) in enumerate(window):
            x = per_step[j]
            if math.isfinite(x) and len(self._history) >= min(10, cfg.spike_window):
                spike, base, _ = spike_score(list(self._history), x, cfg.spike_factor)
                if spike:
                    gn = f"; gradient norm {grad_total:.4g} (last look {self._last_grad_norm:.4g})" if st == step else ""
                    self._note(f"spike:{st}", Finding("warning", f"loss spiked at step {st} to {x:.4g} ({x / base:.1f}x the median {base:.4g} of the {len(self._history)} steps before)",
                                                      f"loss averaged over {self.world} rank(s){gn}", fix="Check the batch at that step; clip gradients if the gradient norm jumped too.", confidence=0.8), step)
            if math.isfinite(x):
                self._history.append(x)
        comps = {}
        if comp_names:
            for i, k in enumerate(comp_names):
                comps[k] = sum(s[_HEAD + cfg.every + i] for s in slots) / len(slots)
            for key, f in checks.component_checks(comps, cfg, step):
                self._note(key, f, step)
        code = code_stats(hist) if cfg.num_codes and sum(hist) > 0 else None
        if code is not None:
            for key, f in checks.code_checks(code, cfg.num_codes, cfg, step):
                self._note(key, f, step)
        entropy = vocab = None
        if ent and ent[1] > 0:
            entropy, vocab = ent[0] / ent[1], int(round(ent[2] / ent[1]))
            for key, f in checks.entropy_checks(entropy, vocab, cfg, step):
                self._note(key, f, step)
        self._last_grad_norm = grad_total
        self._trace_local = None  # shipped in this look's vector
        self._record(step, window, per_step, slots, grad_total, group_norms, param_norm, update_ratio, upd_step if has_upd > 0.5 else None, comps, code, entropy)

    def _record(self, step, window, per_step, slots, grad_total, group_norms, param_norm, update_ratio, upd_step, comps, code, entropy) -> None:
        rec: dict[str, Any] = {"step": step, "loss": per_step[-1] if per_step else math.nan, "grad_norm": grad_total, "param_norm": param_norm}
        if self.world > 1 and window:
            rec["loss_by_rank"] = {str(self.global_ranks[r]): s[_HEAD + len(window) - 1] for r, s in enumerate(slots)}
        rec["grad_norm_by_module"] = group_norms
        if upd_step is not None:
            rec["update_ratio"] = update_ratio
            rec["update_step"] = int(round(upd_step))
        if comps:
            rec["loss_components"] = comps
        if code is not None:
            rec["codes"] = code
        if entropy is not None:
            rec["entropy"] = entropy
        self.last = rec
        if self.rank != 0:
            return
        for j, (st, _) in enumerate(window[:-1]):
            self._write({"step": st, "loss": per_step[j]})
        # grad_norm_by_module flattens to grad_norm_by_module/<group> in distdiag analyze
        self._write(rec)
        if self._log is not None:
            self._log.flush()
        if self._tb is not None:
            for j, (st, _) in enumerate(window):
                self._tb.add_scalar("loss", per_step[j], st)
            for k in ("grad_norm", "param_norm", "update_ratio", "entropy"):
                if k in rec and math.isfinite(rec[k]):
                    self._tb.add_scalar(k, rec[k], step)
