"""Bugs in a hand-written gradient accumulation, each with the same healthy twin.

DISTDIAG_ACCUM=zero_grad: `optimizer.zero_grad()` inside the accumulation loop, so only the last
micro-batch's gradient reaches the step. DISTDIAG_ACCUM=clip: `clip_grad_norm_` after every
micro-batch's backward instead of once before the step. DISTDIAG_MICRO micro-batches (default 4),
cut with the workload's own contiguous split (DISTDIAG_SPLIT=strided: rows i, i + MICRO, ...,
which the diagnosis's contiguous slices do not fit: it must then claim no mechanism). The twin zeroes once before the loop and clips once
after it; every micro-batch loss is a token-loss sum over the global count, so they add up to
the global batch's loss.
"""

import os

import torch
from _twin import HEALTHY

from distdiag.workloads import get_workload
from distdiag.workloads.base import split_batch

_w = get_workload("transformer", int(os.environ.get("WORLD_SIZE", "1")))
build_model, make_batch, loss_fn, shard_batch = _w.build_model, _w.make_batch, _w.loss_fn, _w.shard_batch
MICRO = int(os.environ.get("DISTDIAG_MICRO", "4"))
BUG = os.environ.get("DISTDIAG_ACCUM", "zero_grad")
STRIDED = os.environ.get("DISTDIAG_SPLIT") == "strided"
MAX_NORM = 0.2


def train_step(model, batch, optimizer):
    total = 0.0
    optimizer.zero_grad(set_to_none=True)
    for i in range(MICRO):
        if not HEALTHY and BUG == "zero_grad":
            optimizer.zero_grad(set_to_none=True)  # the bug: clears the earlier micro-batches' gradients
        part = ({k: v[i::MICRO] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in batch.items()}
                if STRIDED else split_batch(batch, i, MICRO))
        loss = loss_fn(model, part)
        loss.backward()
        if not HEALTHY and BUG == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # the bug: a clip per micro-batch
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    return torch.tensor(total)
