"""Fixes for exceptions that distributed jobs raise often, keyed by their message.

A rank's exception leads a hang report when it stranded the others; when its message is one
of these, the finding says what to change instead of a generic "the exception is the cause".
"""

from __future__ import annotations

import re

__all__ = ["fix_for", "GENERIC_FIX"]

GENERIC_FIX = "the exception is the cause; the ranks waiting for this rank are its consequence"

_KNOWN: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"Expected to have finished reduction in the prior iteration"),
        "DDP saw parameters that got no gradient in the last step (a rank-dependent branch, or layers the loss does "
        "not use): make every parameter take part in the loss on every rank, or pass find_unused_parameters=True to "
        "DistributedDataParallel (TORCH_DISTRIBUTED_DEBUG=INFO names the parameters)",
    ),
    (
        re.compile(r"Numpy is not available|No module named 'numpy'"),
        "install numpy where the job runs (pip install numpy): torch's object collectives and DCP need it, and "
        "only the rank that decodes (DCP's coordinator, rank 0) fails without it",
    ),
    (
        re.compile(r"Received data size doesn't match|size mismatch|shape mismatch", re.IGNORECASE),
        "the ranks passed tensors of different sizes to the same collective: look for data-dependent shapes "
        "(the last, smaller batch; uneven splits) around the call",
    ),
    (
        re.compile(r"out of memory", re.IGNORECASE),
        "this rank ran out of memory while the others went on: lower its batch or sequence length, or look for "
        "imbalanced data (a longer sequence on that rank)",
    ),
    (
        re.compile(r"NCCL (error|WARN)|ncclInternalError|ncclSystemError|ncclUnhandledCudaError|ncclRemoteError"),
        "an NCCL error on this rank: rerun with NCCL_DEBUG=INFO; check the rank's GPU and network link "
        "(the gate profile, `distdiag check --profile gate`, tests both)",
    ),
)


def fix_for(exc_type: str, message: str) -> str | None:
    """The specific fix for an exception's type and message, or None."""
    text = f"{exc_type}: {message}"
    for pattern, fix in _KNOWN:
        if pattern.search(text):
            return fix
    return None
