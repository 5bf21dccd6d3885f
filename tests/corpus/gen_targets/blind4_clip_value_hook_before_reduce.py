"""Bug: gradient value clipping is done with a tensor hook on every parameter (`p.register_hook(lambda g: g.clamp(-c, c))`), registered when the model is built. Under DistributedDataParallel the hook runs on each rank's local gradient before DDP's all-reduce, so the ranks clip their own gradients and DDP averages the clipped values; the single-process run clips the gradient of the whole batch.

Report: "one could do gradient clipping locally (before allreduce) or globally (after allreduce). In PyTorch,
gradient clipping is done globally (after allreduce). In MXNet and TensorFlow ... gradient clipping is done
locally (before allreduce)" (horovod/horovod issue #1346); "does it clip the grads before reducing the grads?
how to clip the grads after reducing the grads?" (facebookresearch/maskrcnn-benchmark issue #347); NVIDIA/apex
pull request #1096 ("Distributed LAMB: Clip grads before reduce_scatter/all_reduce"). Symptom: "with value
clipping on, 2 GPUs and 1 GPU give different updates from the first step; with it off they match".
Twin: no hooks; train_step calls `clip_grad_value_` after the backward, on the reduced gradients.
"""

import torch
from _base import HEALTHY, loss_fn, make_batch, shard_batch  # noqa: F401
from _base import build_model as _build_model
from torch.nn.parallel import DistributedDataParallel

CLIP = 0.02


def build_model():
    model = _build_model()
    if not HEALTHY:
        for p in model.parameters():
            p.register_hook(lambda g: g.clamp(-CLIP, CLIP))  # the bug: runs before DDP's all-reduce
    return model


def parallelize(model, mesh):
    return DistributedDataParallel(model)


def train_step(model, batch, optimizer):
    loss = loss_fn(model, batch)
    loss.backward()
    if HEALTHY:
        torch.nn.utils.clip_grad_value_(model.parameters(), CLIP)
    optimizer.step()
    return loss
