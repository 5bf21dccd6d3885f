"""A target whose import kills rank 1 (a native crash or os._exit in the user's package)."""

import os

if os.environ.get("RANK") == "1":
    os._exit(7)


def build_model():  # pragma: no cover - never reached on rank 1; the others wait for it
    import torch

    return torch.nn.Linear(4, 4)
