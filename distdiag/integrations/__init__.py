"""distdiag inside the trainers people use (issue 12; docs/integrations/).

- `distdiag.integrations.hf.DistdiagCallback`: a `transformers.TrainerCallback`;
- `distdiag.integrations.lightning.DistdiagCallback`: a `lightning.pytorch.Callback`;
- accelerate (or any own loop): the zero-code wrapper `torchrun -m distdiag.watch -- train.py`
  unchanged; `mark_step(step)` in the loop adds step marks (docs/integrations/accelerate.md).

Both callbacks translate their trainer's events into one framework-free TrainerDiagnostics.
Importing this package imports neither transformers, lightning nor torch; each callback
module needs its framework and says which package to install when it is missing.
Modules: hf, lightning (the callbacks), session (TrainerDiagnostics), config
(DiagnosticsConfig), wrapper (the zero-code wrapper seen from the script). May import
distdiag.watchdog, distdiag.watch, distdiag.monitor, distdiag.report, distdiag.errors and
distdiag.check.config (for parsing its options).
"""

from __future__ import annotations

from distdiag.integrations.config import DiagnosticsConfig
from distdiag.integrations.session import TrainerDiagnostics
from distdiag.integrations.wrapper import mark_step, wrapper_watchdog

__all__ = ["DiagnosticsConfig", "TrainerDiagnostics", "mark_step", "wrapper_watchdog"]
