"""distdiag in the Hugging Face Trainer: a `transformers.TrainerCallback`.

    from distdiag.integrations.hf import DistdiagCallback
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[DistdiagCallback()])

What it hooks (docs/integrations/hf_trainer.md):
- on_train_begin: arms the hang watchdog (or adopts the one `-m distdiag.watch` armed) and builds
  the TrainingMonitor on the unwrapped model and the torch optimizer inside accelerate's wrapper;
- on_step_begin: a step mark with the Trainer's own counter (`state.global_step`);
- the model's forward output `loss` in training mode: the loss the Trainer backpropagates;
- on_pre_optimizer_step (after backward and clipping, before `optimizer.step()`): the monitor,
  then the non-finite skip;
- on_step_end / on_epoch_end: what the Trainer is about to do (control.should_log / should_evaluate /
  should_save) becomes a watchdog phase with that budget once every rank has reached it (the
  evaluation's first on_prediction_step, the checkpoint after the log / evaluation before it),
  left again at on_log / on_evaluate / on_save;
- on_log: findings above info go into `state.log_history` (trainer_state.json) as
  `{"distdiag_finding": {...}, "step": N}`, which `distdiag analyze` reads back; the monitor's JSONL
  goes to OUTPUT_DIR/distdiag-metrics.jsonl, next to the Trainer's TensorBoard runs.

Importing this module needs transformers (a clear ImportError otherwise); distdiag itself does not.
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        f"distdiag.integrations.hf needs Hugging Face transformers ({exc}); install it with: pip install transformers"
    ) from None

from distdiag.check.config import dataclass_from_dict
from distdiag.integrations.config import DiagnosticsConfig
from distdiag.integrations.session import TrainerDiagnostics
from distdiag.report.model import Finding

__all__ = ["DistdiagCallback", "FINDING_KEY"]

_LOCAL_REPORTERS = {"tensorboard", "none"}
"""report_to integrations that write local files: their logging needs no phase budget."""

FINDING_KEY = "distdiag_finding"
"""The key of the log_history entries that carry a finding (trainer_state.json)."""


class DistdiagCallback(TrainerCallback):
    """Hang watchdog + training monitor for `transformers.Trainer`; keywords are DiagnosticsConfig's."""

    def __init__(self, config: DiagnosticsConfig | None = None, **options: Any) -> None:
        self.config = config if config is not None else dataclass_from_dict(DiagnosticsConfig, options, "integrations")
        self.session = TrainerDiagnostics(self.config, "Hugging Face Trainer")
        self._hook: Any = None
        self._in_step = False
        self._pending: set[str] = set()
        self._uploads = False
        self._loss_scale = 1

    @property
    def findings(self) -> list[Finding]:
        """Everything found so far (every rank holds the same monitor findings)."""
        return self.session.findings()

    # -- training ---------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        # accelerate wraps the torch optimizer; the monitor's step hooks belong on the inner one
        inner = getattr(optimizer, "optimizer", optimizer)
        self.session.start(model, inner, log_dir=args.output_dir, output_dir=args.output_dir)
        self._pending = set()
        self._uploads = any(r not in _LOCAL_REPORTERS for r in (args.report_to or []))
        # With average_tokens_across_devices the model's loss is divided by the token count of
        # every rank and the Trainer multiplies it back by the world size (Trainer.compute_loss).
        self._loss_scale = args.world_size if getattr(args, "average_tokens_across_devices", False) else 1
        if model is not None and self.session.monitor is not None:
            self._hook = model.register_forward_hook(self._capture_loss, with_kwargs=True)

    def on_step_begin(self, args, state, control, **kwargs):
        self._in_step = True
        self._pending.clear()
        self.session.mark_step(state.global_step)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._in_step = False
        self.session.before_optimizer_step(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self._plan(state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._plan(state, control)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.session.leave_phase("logging")
        self._pending.discard("logging")
        self._publish(state)
        if self._pending == {"checkpoint"}:
            self.session.enter_phase("checkpoint")

    def on_prediction_step(self, args, state, control, **kwargs):
        # the first evaluation batch has been gathered: every rank is evaluating
        if "evaluation" in self._pending and self.session.phase != "evaluation":
            self.session.enter_phase("evaluation")

    def on_evaluate(self, args, state, control, **kwargs):
        self.session.leave_phase("evaluation")
        self._pending.discard("evaluation")
        if self._pending == {"checkpoint"}:
            self.session.enter_phase("checkpoint")

    def on_save(self, args, state, control, **kwargs):
        self.session.leave_phase("checkpoint")
        self._pending.discard("checkpoint")

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._publish(state)
        self.session.finish()

    # -- helpers ----------------------------------------------------------------------------
    def _plan(self, state: Any, control: Any) -> None:
        """What the Trainer does after this step (DefaultFlowCallback, first in the handler, has
        set the flags): log (a gather, then the reporters), evaluate, save, in that order.

        A phase starts only once every rank has reached that work (session.enter_phase): the
        checkpoint phase here when nothing with a collective comes before it, else at on_log /
        on_evaluate; the evaluation phase at its first prediction step; the logging phase only on
        the process that reports, and only for reporters that upload (a TensorBoard file needs no
        budget), since it opens before the Trainer's gather of the loss.
        """
        self._pending = {n for n, flag in (("logging", control.should_log), ("evaluation", control.should_evaluate),
                                           ("checkpoint", control.should_save)) if flag}
        if "logging" in self._pending and self._uploads and state.is_world_process_zero:
            self.session.enter_phase("logging")
        elif self._pending == {"checkpoint"}:
            self.session.enter_phase("checkpoint")

    def _capture_loss(self, module: Any, inputs: Any, kwargs: Any, output: Any) -> None:
        if not (self._in_step and module.training):
            return
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if loss is None or not hasattr(loss, "detach") or loss.numel() != 1:
            return
        if kwargs.get("num_items_in_batch") is not None:
            # the model divided by the tokens of the whole step (all micro-batches, maybe all ranks)
            self.session.record_loss(loss * self._loss_scale, part=True)
        else:
            self.session.record_loss(loss)

    def _publish(self, state: Any) -> None:
        # every rank appends (their monitors agree); rank 0 writes trainer_state.json
        for f in self.session.new_findings():
            state.log_history.append({FINDING_KEY: f.to_dict(), "step": state.global_step})
