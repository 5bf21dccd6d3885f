"""Bug: train_step accumulates micro-batches of a fixed size (2 rows) and steps the learning-rate scheduler after every micro-batch instead of after every optimizer step. The scheduler then advances by the number of micro-batches this process ran: 4 per step on one process holding the 8-row global batch, 2 per step on each of 2 ranks, so the warmup runs at a different pace and the ranks step with another learning rate than the single-process run.

Report: "when I use 1 gpu, I set accumulate_grad_batches = 4, and when I use 4 gpus, I set
accumulate_grad_batches = 1. Then I noticed the LR scheduler ... displayed different LR during training"
(huggingface/pytorch-image-models issue #1235, Lightning-AI/pytorch-lightning issue #12894); "lr_scheduler.step()
is called on every micro-batch ... This causes the LR scheduler to advance gradient_accumulation_steps times
faster than intended" (starVLA/starVLA pull request #210); "standard learning rate warmups of say 16000 steps
would actually only warm up for 1000 steps if I set accumulate_grad_batches=16" (Lightning-AI/pytorch-lightning
issue #1476). Symptom: "same global batch on 1 and 2 GPUs, the learning-rate curves differ; loss and gradients
at step 1 match, the weights after it do not".
Twin: the scheduler steps once per optimizer step, after `optimizer.step()`.
"""

import torch
from _base import HEALTHY, build_model, loss_fn, make_batch, shard_batch  # noqa: F401

LR, WARMUP, MICRO_ROWS = 0.2, 10, 2


def build_optimizer(params):
    optimizer = torch.optim.SGD(params, lr=LR)
    optimizer.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / WARMUP))
    return optimizer


def train_step(model, batch, optimizer):
    rows = batch["tokens"].shape[0]
    total = 0.0
    for start in range(0, rows, MICRO_ROWS):
        part = {k: (v[start:start + MICRO_ROWS] if hasattr(v, "shape") and v.dim() else v) for k, v in batch.items()}
        loss = loss_fn(model, part)  # a token sum over the global count: the micro-batch losses add up
        loss.backward()
        total += float(loss.detach())
        if not HEALTHY:
            optimizer.scheduler.step()  # the bug: once per micro-batch, and this process's count of them
    optimizer.step()
    if HEALTHY:
        optimizer.scheduler.step()
    return total
