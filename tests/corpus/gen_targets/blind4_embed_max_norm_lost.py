"""Bug: the embedding is built with `max_norm=1.0`, which renormalises the looked-up rows of the weight in place during the forward. Under FSDP2 the forward runs on the all-gathered, unsharded copy of the weight, which is freed at reshard: the renormalisation never reaches the sharded parameter. The single-process run keeps its renormalised rows; the sharded run steps from the rows as they were.

Report: "When max_norm is not None, Embedding's forward method will modify the weight tensor in-place"
(pytorch/pytorch pull request #45595, the note added for issue #26596); "If the unsharded parameters are
registered to the module, the `module.weight` returns the unsharded `weight`" during FSDP2's forward
(pytorch/pytorch issue #144289: the unsharded parameter is the all-gather's output, not the sharded
storage). Symptom: "with an embedding max_norm the FSDP run drifts from 1 GPU after the first step; the
loss and gradients at step 1 match; the saved embedding rows have norms above max_norm".
Twin: no in-place write in the forward: train_step renormalises the embedding rows on the parameter itself
(each rank its own rows, a row-wise operation) before the forward, the same in one process.
"""

import torch
from _base import HEALTHY, loss_fn, make_batch, shard_batch  # noqa: F401
from _base import build_model as _build_model
from torch.distributed.tensor import DTensor

MAX_NORM = 1.0


def build_model():
    model = _build_model()
    if not HEALTHY:
        model.embed.max_norm = MAX_NORM  # the bug: nn.Embedding(max_norm=...) renorms in the forward, in place
    return model


def train_step(model, batch, optimizer):
    if HEALTHY:
        with torch.no_grad():
            w = model.embed.weight
            rows = w.to_local() if isinstance(w, DTensor) else w
            rows.mul_((MAX_NORM / (rows.norm(dim=1, keepdim=True) + 1e-7)).clamp(max=1.0))
    loss = loss_fn(model, batch)
    loss.backward()
    optimizer.step()
    return loss
