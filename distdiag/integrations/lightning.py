"""distdiag in Lightning: a `lightning.pytorch.Callback`.

    from distdiag.integrations.lightning import DistdiagCallback
    trainer = L.Trainer(strategy="ddp", callbacks=[DistdiagCallback()])

What it hooks (docs/integrations/lightning.md):
- on_train_start: arms the hang watchdog (or adopts the one `-m distdiag.watch` armed) and builds
  the TrainingMonitor on the LightningModule; its JSONL goes to `trainer.log_dir` (the logger's
  version folder, next to metrics.csv or the event files);
- on_train_batch_start: a step mark with `trainer.global_step`;
- on_before_backward: the loss Lightning backpropagates (already divided by accumulate_grad_batches);
- on_before_optimizer_step (gradients complete, before clipping and the update): the monitor,
  then the non-finite skip;
- validation during fit and checkpoint saving are watchdog phases with their budgets;
- findings: rank 0 logs each as it appears (the `distdiag.monitor` logger) and writes it into the
  JSONL in `trainer.log_dir`, which `distdiag analyze` reads with the logger's metrics.csv / events.

The monitor gets no optimizer here: Lightning runs the training step inside `optimizer.step(closure)`,
after the optimizer's step pre-hooks, so the update/parameter ratio (which snapshots the parameters
in that pre-hook) is not measured under Lightning.

Importing this module needs Lightning (`lightning`, else the older `pytorch_lightning`), with a
clear ImportError naming the package otherwise; distdiag itself does not.
"""

from __future__ import annotations

from typing import Any

try:
    import lightning.pytorch as pl
except ImportError:
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]  # the package's name before Lightning 2.0
    except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
        raise ImportError(
            f"distdiag.integrations.lightning needs Lightning ({exc}); install it with: pip install lightning"
        ) from None

from distdiag.check.config import dataclass_from_dict
from distdiag.integrations.config import DiagnosticsConfig
from distdiag.integrations.session import TrainerDiagnostics
from distdiag.report.model import Finding

__all__ = ["DistdiagCallback"]

class DistdiagCallback(pl.Callback):
    """Hang watchdog + training monitor for Lightning's Trainer; keywords are DiagnosticsConfig's."""

    def __init__(self, config: DiagnosticsConfig | None = None, **options: Any) -> None:
        self.config = config if config is not None else dataclass_from_dict(DiagnosticsConfig, options, "integrations")
        self.session = TrainerDiagnostics(self.config, "Lightning")

    @property
    def findings(self) -> list[Finding]:
        """Everything found so far (every rank holds the same monitor findings)."""
        return self.session.findings()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        log_dir = trainer.log_dir  # a broadcast from rank 0: every rank calls it here
        self.session.start(pl_module, None, log_dir=log_dir, output_dir=trainer.default_root_dir)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.session.mark_step(trainer.global_step)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self.session.active:
            self.session.record_loss(loss, part=True)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.session.active:
            self.session.before_optimizer_step(trainer.global_step)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.session.active and not trainer.sanity_checking:
            self.session.enter_phase("evaluation")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.session.leave_phase("evaluation")

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        # Lightning has no hook after the write: the phase lasts until the next step or validation
        if self.session.active:
            self.session.enter_phase("checkpoint")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.session.finish()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.session.finish(exception)
