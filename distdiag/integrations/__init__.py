"""distdiag inside the trainers people use (issue 12; docs/integrations/).

- `distdiag.integrations.hf.DistdiagCallback`: a `transformers.TrainerCallback`;
- `distdiag.integrations.lightning.DistdiagCallback`: a `lightning.pytorch.Callback`;
- accelerate scripts: the zero-code wrapper `torchrun -m distdiag.watch -- train.py` unchanged,
  step marks through `distdiag.watch.armed()` (docs/integrations/accelerate.md).

Both callbacks translate their trainer's events into one framework-free TrainerDiagnostics.
Importing this package imports neither transformers, lightning nor torch; each callback
module needs its framework and says which package to install when it is missing.
"""

from __future__ import annotations

from distdiag.integrations.config import DiagnosticsConfig
from distdiag.integrations.session import TrainerDiagnostics

__all__ = ["DiagnosticsConfig", "TrainerDiagnostics"]
