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

import atexit
import dataclasses
import json
import logging
import math
import weakref
from pathlib import Path
from typing import Any

import torch

from distdiag.monitor.checks import param_findings
from distdiag.monitor.config import MonitorConfig
from distdiag.monitor.look import LookReader, code_histogram, entropy_sums, pack_components
from distdiag.monitor.stats import ParamGroups, embedding_modules, param_counts
from distdiag.monitor.trace import NaNScan, NonFiniteTracer
from distdiag.report.model import Finding, ProbeResult
from distdiag.runtime.settle import idle_at_exit, use_counts, wait_released

__all__ = ["TrainingMonitor"]

_LAST_LOOK: list[tuple[weakref.ref[torch.Tensor], list[int | None]]] = []
"""The latest look's all_reduce tensor (weakly) and its use count before the call: a script that
ends without close() right after a look is settled at exit (`_settle_at_exit`)."""


def _remember_last_look(vec: torch.Tensor, held: list[int | None]) -> None:
    if not _LAST_LOOK:
        idle_at_exit()  # then the script's own last collective: after ours (last in, first out)
        atexit.register(_settle_at_exit)
    _LAST_LOOK[:] = [(weakref.ref(vec), held)]


def _settle_at_exit() -> None:
    """atexit (before Python finalizes): if gloo's worker still holds the last look's tensor, wait
    until it lets go (at most 2 s), so that it never frees it while the interpreter shuts down."""
    for ref, held in _LAST_LOOK:
        vec = ref()
        if vec is not None:
            wait_released([vec], held)
    _LAST_LOOK.clear()

log = logging.getLogger("distdiag.monitor")

METRICS_SCHEMA = "distdiag.metrics/1"

CLOSE_WAIT_S = 5.0
"""How long close() waits for every rank of the group to reach it before its last look (an
all_reduce): ranks that do not all arrive skip that look together instead of hanging."""

_created = [0]
"""Distributed monitors this process made: every rank makes them in the same order, so the
count names the store keys with which the ranks agree on close()'s last look."""


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
        self.config = _resolve_config(config, every, overrides)
        cfg = self.config
        self.model = model
        self.group = group
        self._warned_codes = False
        self.distributed, self.world, self.global_ranks, self.rank = _placement(group)
        self._index = _created[0]
        _created[0] += int(self.distributed)
        # DDP's wrapper adds a "module." prefix to every name: report the user's names
        inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        self.groups = ParamGroups(inner, cfg.depth, self.world)
        self.tracer = NonFiniteTracer(inner)
        self.scan: NaNScan = self.tracer.scan
        """A NaN made inside a module's forward (also one replaced before its output): checked at
        step 0 and every `nan_scan_every` steps (distdiag/monitor/trace.py)."""
        self._scan_until = -1
        self._scan_named = False
        self._reader = LookReader(cfg, self.groups, self.tracer, self.global_ranks)
        """Reads each look's all-reduced vector; keeps the loss history spikes are measured against."""
        self._pending: list[tuple[int, torch.Tensor]] = []
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
        self.last: dict[str, Any] = {}
        """The values of the last look (what rank 0 logged; close() adds the last step's loss)."""
        # the log first: a path it refuses (a link, a FIFO) must leave no hook on the optimizer
        self._log = _open_log(log) if self.rank == 0 and log is not None else None
        if optimizer is not None:
            self._hooks.append(optimizer.register_step_pre_hook(self._opt_pre))
            self._hooks.append(optimizer.register_step_post_hook(self._opt_post))
        self._tb = _open_tensorboard(tensorboard) if self.rank == 0 and tensorboard is not None else None
        counts = param_counts(inner)
        self._write({"kind": "header", "schema": METRICS_SCHEMA, "every": cfg.every, "world_size": self.world, "params": counts})
        self._param_findings(counts, embedding_modules(inner))
        if cfg.trace == "always":
            self.tracer.arm(0)
        if cfg.trace != "off" and cfg.nan_scan_every:
            self.scan.arm(0, naming=False)

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
        if self.scan.waiting:
            self._scan_done(step)
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

    def close(self, *, look: bool = True) -> list[Finding]:
        """Look at the steps after the last look (their losses written and checked: a NaN at the
        last step is found), remove every hook and close the log; returns the findings.

        That last look is one all_reduce like any other: call close() on every rank. `look=False`
        (what leaving a `with` block by an exception does) skips it: ranks that stopped at
        different points must not wait for each other."""
        if look:
            self._final_look()
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

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(look=exc_type is None)

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
        scan = cfg.trace != "off" and cfg.nan_scan_every > 0 and not self._scan_named
        if scan and (step < self._scan_until or (step + 1) % cfg.nan_scan_every == 0):
            self.scan.arm(step + 1, naming=step < self._scan_until)

    def _scan_done(self, step: int) -> None:
        """Read the step's NaN scan: a NaN seen cheaply arms the naming scan for `trace_steps`."""
        got = self.scan.result()
        self.scan.disarm()
        if got is True and not self.scan.naming:
            self._scan_until = step + self.config.trace_steps
        elif got:
            self._scan_named, self._scan_until = True, -1
            if self._trace_local is None:
                self._trace_local = (got.module_index, got.phase, got.step)  # type: ignore[union-attr]

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

    def _param_findings(self, counts: list[dict], emb: tuple[list[str], int]) -> None:
        for key, finding in param_findings(counts, *emb):
            self._note(key, finding, 0)

    def _final_look(self) -> None:
        """The steps after the last look: a look at the last of them, whose gradients are left out
        (the optimizer has stepped and may have zeroed them: not the step's gradients any more)."""
        import torch.distributed as dist

        if not self._pending:
            return
        why = None
        if self.distributed and not dist.is_initialized():
            why = "the process group was destroyed before TrainingMonitor.close(); close it first"
        elif self.distributed and self.world > 1 and not _all_ranks_closing(self._index, self.global_ranks, CLOSE_WAIT_S):
            # A rank that left its loop early (uneven data) must not be held in an all_reduce
            # its peers, still training, pair with their own collectives.
            why = f"the ranks did not all reach TrainingMonitor.close() within {CLOSE_WAIT_S:g}s"
        if why is not None:
            if self.rank == 0:
                first, last = self._pending[0][0], self._pending[-1][0]
                log.warning("the last %d step(s) (%d..%d) were not checked: %s", len(self._pending), first, last, why)
            self._pending.clear()
            return
        self._look(self._pending[-1][0], None, None, None, final=True)

    def _look(
        self, step: int, components: dict | None, codes: torch.Tensor | None, logits: torch.Tensor | None, *, final: bool = False
    ) -> None:
        """Pack this rank's slot and its share of the sums (layout: distdiag.monitor.look), all_reduce, decode."""
        import torch.distributed as dist

        cfg, groups, dev = self.config, self.groups, self.groups.device
        window = self._pending[-cfg.every :]
        self._pending.clear()
        G = groups.width  # the groups' sums, then one slot per same-kind parameter
        grad_sq, grad_plain, grad_bad = groups.grads()
        par_sq, par_plain, _ = groups.values()
        comp_names, comp_vals, comp_hash = pack_components(components, cfg.max_components, dev)
        losses = torch.full((cfg.every,), math.nan, dtype=torch.float64, device=dev)
        if window:
            losses[: len(window)] = torch.stack([v.to(dev) for _, v in window])
        trace = self._trace_local or (-1, 0, -1)
        head = torch.tensor([step, 0.0, 0.0, 0.0, 0.0, *trace, comp_hash, len(window)], dtype=torch.float64, device=dev)
        head[2], head[3], head[4] = grad_plain, grad_bad, par_plain
        slot = torch.cat([head, losses, comp_vals])
        K = slot.numel()
        upd_step, upd_sq = self._update if self._update is not None else (-1, torch.zeros(G, dtype=torch.float64, device=dev))
        hist = code_histogram(codes, cfg.num_codes, dev)
        ent = entropy_sums(logits, dev)
        has_upd = torch.tensor([1.0 if self._update is not None else 0.0, float(upd_step)], dtype=torch.float64, device=dev) / self.world
        vec = torch.zeros(self.world * K, dtype=torch.float64, device=dev)
        vec[self.rank * K : (self.rank + 1) * K] = slot
        vec = torch.cat([vec, grad_sq, par_sq, upd_sq.to(dev), has_upd, hist, ent])
        held = None
        if self.distributed and self.world > 1:
            held = use_counts([vec])
            dist.all_reduce(vec, group=self.group)
        values = vec.tolist()  # the one device sync of a look
        if held is not None and final:
            # close() is often the script's last collective: let the backend's worker drop `vec`
            # while Python still runs (distdiag.runtime.settle says why). After the device sync
            # above: on NCCL the work is held until the GPU has finished it.
            wait_released([vec], held)
        elif held is not None:
            _remember_last_look(vec, held)
        self._update = None
        if codes is not None and cfg.num_codes == 0 and not self._warned_codes:
            # once per run, not at every look: the same sentence each look buried the findings
            self._warned_codes = True
            log.warning("codes= passed without num_codes=: code statistics are off (pass TrainingMonitor(..., num_codes=N))")
        self._decode(step, values, K, G, window, comp_names, final)
        self._snapshot_next, self._snapshot_step = not final, step

    def _decode(self, step: int, values: list[float], K: int, G: int, window: list, comp_names: list[str], final: bool) -> None:
        """Note what the ranks' sum says, plan the tracing from it, and record the look."""
        cfg = self.config
        look = self._reader.read(step, values, K, G, window, comp_names, final=final)
        for key, f in look.findings:
            self._note(key, f, step)
        if look.nonfinite and cfg.trace == "auto" and self._trace_local is None:
            self._trace_until = step + cfg.trace_steps
        if look.traced:
            self._trace_done, self._trace_until = True, -1
        self._trace_local = None  # shipped in this look's vector
        self._record(step, window, look.losses, look.record, final)

    def _record(self, step: int, window: list, per_step: list[float], rec: dict[str, Any], final: bool = False) -> None:
        """Keep the look's values as `last`; rank 0 writes them to the log and TensorBoard.
        close()'s look measures fewer things (no gradients, codes, ...): it updates `last`."""
        self.last = {**self.last, **rec} if final else rec
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


def _resolve_config(config: MonitorConfig | None, every: int | None, overrides: dict[str, Any]) -> MonitorConfig:
    """`config` (default MonitorConfig()) with the keywords given; unknown ones name monitor.KEY."""
    from distdiag.check.config import dataclass_from_dict

    base = config or MonitorConfig()
    if every is not None:
        overrides["every"] = every
    return dataclass_from_dict(MonitorConfig, {**dataclasses.asdict(base), **overrides}, "monitor") if overrides else base


def _placement(group: Any) -> tuple[bool, int, list[int], int]:
    """(distributed, world size, global rank of each group rank, this rank) in `group` (default: the world)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        return True, world, ranks, dist.get_rank(group)
    return False, 1, [0], 0


def _all_ranks_closing(index: int, ranks: list[int], wait_s: float) -> bool:
    """Whether every rank of the group reached close() (True: all of them do the last look).

    Each rank posts its arrival in the job's store and waits up to `wait_s` for the others;
    the outcome is ONE key set with compare_set by the first rank to decide - "look" when it
    saw every arrival, "skip" when its wait ran out - so a rank arriving after another gave up
    reads "skip" and no rank is left alone in the all_reduce."""
    import time
    import zlib

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    base = f"distdiag/monitor{index}/close/{zlib.crc32(','.join(map(str, ranks)).encode()):08x}"
    decision = f"{base}/decision"
    # Arrivals are counted, and the last rank to arrive decides "look": a poll reads one key
    # (it read every rank's arrival key, N^2 keys a round at 16k ranks - issue 21), and the
    # ranks poll at most 25,000 times a second together, as distdiag/runtime/exchange.py's waits.
    if int(store.add(f"{base}/n", 1)) >= len(ranks):
        return store.compare_set(decision, "", "look") == b"look"
    interval = max(0.02, len(ranks) / 25_000)
    end = time.monotonic() + wait_s
    while True:
        if store.check([decision]):
            return store.get(decision) == b"look"
        if time.monotonic() >= end:
            return store.compare_set(decision, "", "skip") == b"look"
        time.sleep(interval)


def _open_log(log: str | Path) -> Any:
    """The JSONL metrics log, opened for appending (its folder made). A symbolic link, FIFO or
    device there is refused with one line (RefusedFile, an OSError): distdiag/report/safefile.py."""
    from distdiag.report.safefile import open_append

    return open_append(log, "pass the monitor's log a file path")


def _open_tensorboard(logdir: str | Path) -> Any:
    """A TensorBoard SummaryWriter, or None (with a warning) when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(logdir))
    except ImportError:
        log.warning("tensorboard is not installed: metrics go to the JSONL log only")
        return None
