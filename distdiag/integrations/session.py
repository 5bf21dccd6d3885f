"""TrainerDiagnostics: the framework-free part of distdiag's trainer callbacks.

A callback translates its trainer's events into these calls, in this order per step:

    start(model, optimizer, log_dir=..., output_dir=...)    once, when training starts
    mark_step(step)                                         each step begins: watchdog progress
    record_loss(loss)                                       each micro-batch's loss (device scalar)
    before_optimizer_step(step)                             gradients complete, update not applied
    enter_phase(name) / leave_phase(name)                   evaluation, checkpoint, logging
    finish(error)                                           training ended (or failed)

Collectives: before_optimizer_step runs the TrainingMonitor, whose looks (every `every` steps)
issue one all_reduce, so it must run on every rank at the same steps, which the trainers'
hooks do. Nothing else here issues a collective (skip_nonfinite's norm is local: under DDP all
ranks hold the same gradients and take the same decision). Importing this module does not
import torch.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from distdiag.integrations.config import DiagnosticsConfig
from distdiag.report.model import Finding

__all__ = ["TrainerDiagnostics"]

log = logging.getLogger("distdiag.integrations")


class TrainerDiagnostics:
    """Arms the hang watchdog and runs the training monitor for one training run."""

    def __init__(self, config: DiagnosticsConfig, framework: str) -> None:
        self.config = config
        self.framework = framework
        self.watchdog: Any = None
        self.monitor: Any = None
        self.rank = 0
        self.active = False
        self._own_watchdog = False
        self._model: Any = None
        self._loss_sum: Any = None
        self._loss_count = 0
        self._loss_parts = False
        self._phase: tuple[str, Any] | None = None
        self._emitted: set[str] = set()
        self._skipped: list[int] = []
        self._warned_no_loss = False

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self, model: Any, optimizer: Any = None, *, log_dir: str | None = None, output_dir: str | None = None) -> None:
        """Arm the watchdog (or adopt the one `-m distdiag.watch` armed) and build the monitor."""
        import torch.distributed as dist

        if self.active:
            self.finish()
        cfg = self.config
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self._model = model
        self._skipped, self._emitted, self._warned_no_loss = [], set(), False
        if cfg.watchdog and distributed:
            from distdiag.integrations.wrapper import wrapper_watchdog

            wrapper_wd = wrapper_watchdog()
            if wrapper_wd is not None:
                self.watchdog, self._own_watchdog = wrapper_wd, False
            else:
                from distdiag.watchdog import WATCHDOG_DUMP_DIR, HangWatchdog

                dump_dir = cfg.dump_dir
                if dump_dir is None and not os.environ.get(WATCHDOG_DUMP_DIR) and output_dir:
                    dump_dir = os.path.join(output_dir, "hang-report")
                self.watchdog = HangWatchdog(timeout=cfg.timeout, action=cfg.action, dump_dir=dump_dir).start()
                self._own_watchdog = True
        elif cfg.watchdog and self.rank == 0:
            log.info("distdiag: no default process group, so no hang watchdog (it needs at least the process group of a 1-rank job)")
        if cfg.monitor:
            from distdiag.monitor import TrainingMonitor

            path = None
            if cfg.metrics_log is not None:
                path = cfg.metrics_log if os.path.isabs(cfg.metrics_log) or not log_dir else os.path.join(log_dir, cfg.metrics_log)
            self.monitor = TrainingMonitor(model, optimizer=optimizer, every=cfg.every, log=path, **cfg.monitor_options)
        self.active = True

    def finish(self, error: BaseException | None = None) -> list[Finding]:
        """Leave any phase, close the monitor and the watchdog this run armed; returns the findings."""
        if not self.active:
            return self.findings()
        self.active = False
        self.leave_phase(None)
        if self.monitor is not None:
            # the steps after the last look are looked at too (one all_reduce, every rank gets
            # here), unless the run failed: its ranks may have stopped at different points
            self.monitor.close(look=error is None)
        found = self.findings()
        if self.watchdog is not None and self._own_watchdog:
            self.watchdog.close(error)
        self.watchdog = None
        self._loss_sum, self._loss_count = None, 0
        return found

    # -- per step -----------------------------------------------------------------------------
    def mark_step(self, step: int) -> None:
        """A step begins: progress for the watchdog, where ranks also compare their collectives."""
        self.leave_phase(None)
        if self.watchdog is not None:
            self.watchdog.step(step)

    def record_loss(self, loss: Any, *, part: bool = False) -> None:
        """One micro-batch's loss, kept on the device (no sync) until the next look. The step's
        loss is the mean of those recorded, or their sum when each is a `part` of it (a loss
        already divided by the step's token count or by the accumulation steps)."""
        value = loss.detach().reshape(-1)[0].float()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1
        self._loss_parts = part

    def before_optimizer_step(self, step: int) -> bool:
        """After backward, before the update: run the monitor; returns True when the update was
        made a no-op because the gradients hold NaN/Inf (skip_nonfinite)."""
        loss, count = self._loss_sum, self._loss_count
        self._loss_sum, self._loss_count = None, 0
        if self.monitor is not None:
            if count == 0:
                if not self._warned_no_loss and self.rank == 0:
                    log.warning(
                        "distdiag: the %s run gave the monitor no loss (the model's output has no `loss`: a custom "
                        "compute_loss?); it checks gradients only and logs the loss as 0", self.framework,
                    )
                self._warned_no_loss = True
                loss, count = 0.0, 1
            self.monitor.after_backward(loss if self._loss_parts else loss / count, step)
        return self.config.skip_nonfinite and self._skip_if_nonfinite(step)

    def _skip_if_nonfinite(self, step: int) -> bool:
        import torch

        params = [p for p in self._model.parameters() if p.grad is not None]
        if not params:
            return False
        total = torch.nn.utils.get_total_norm([p.grad for p in params], error_if_nonfinite=False)
        if hasattr(total, "full_tensor"):  # DTensor gradients (FSDP2): the norm of the whole
            total = total.full_tensor()
        if bool(torch.isfinite(total)):
            return False
        # Optimizers leave a parameter without a gradient untouched: the update is skipped,
        # as GradScaler skips one, and the parameters stay finite for the monitor's trace.
        for p in params:
            p.grad = None
        self._skipped.append(step)
        if len(self._skipped) == 1 and self.rank == 0:
            log.warning("distdiag: step %d: the gradients hold NaN/Inf; the update is skipped (skip_nonfinite=True)", step)
        return True

    # -- phases -------------------------------------------------------------------------------
    def enter_phase(self, name: str) -> None:
        """Long work without steps (evaluation, checkpoint, logging) under its own budget.

        Enter it only once every rank has reached that work: while a rank is inside a declared
        phase, its peers are not called hung, so a phase entered before a collective that a
        stuck peer never joins would excuse that peer for the whole budget.
        """
        self.leave_phase(None)
        if self.watchdog is None:
            return
        context = self.watchdog.phase(name, timeout=self.config.budget(name))
        context.__enter__()
        self._phase = (name, context)

    def leave_phase(self, name: str | None) -> None:
        """Leave the phase `name` if it is the one declared (None: whichever is)."""
        if self._phase is None or (name is not None and self._phase[0] != name):
            return
        _, context = self._phase
        self._phase = None
        context.__exit__(None, None, None)

    @property
    def phase(self) -> str | None:
        return self._phase[0] if self._phase is not None else None

    # -- findings -----------------------------------------------------------------------------
    def findings(self) -> list[Finding]:
        out = list(self.monitor.findings) if self.monitor is not None else []
        if self._skipped:
            first = self._skipped[0]
            out.append(Finding(
                "warning", f"updates whose gradients held NaN/Inf were skipped from step {first}",
                f"{len(self._skipped)} update(s) skipped, at steps {', '.join(map(str, self._skipped[:10]))}"
                + (" ..." if len(self._skipped) > 10 else ""),
                fix="See the monitor's findings for the module that produced the first non-finite value.",
                confidence=1.0,
            ))
        return out

    def new_findings(self, min_severity: str = "warning") -> list[Finding]:
        """Findings at or above min_severity not returned before (for the trainer's own log)."""
        from distdiag.report.model import SEVERITIES

        floor = SEVERITIES.index(min_severity)
        fresh = []
        for f in self.findings():
            if SEVERITIES.index(f.severity) >= floor and f.issue not in self._emitted:
                self._emitted.add(f.issue)
                fresh.append(f)
        return fresh
