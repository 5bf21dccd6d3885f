"""A target whose import kills rank 1 (a native crash in the user's package: SIGKILL stands
for it, since an os._exit at import is caught and reported as bad input, see
distdiag/check/target.py)."""

import os
import signal

if os.environ.get("RANK") == "1":
    os.kill(os.getpid(), signal.SIGKILL)


def build_model():  # pragma: no cover - never reached on rank 1; the others wait for it
    import torch

    return torch.nn.Linear(4, 4)
