"""Bug: a hand-written global gradient clip under FSDP2 all-reduces each rank's local shard norm and takes the sum as the total norm: the sum of the shards' norms, not the square root of the sum of their squares. The total is overstated, so every rank clips harder than the single-process run (the same factor on every rank).

Report: "it seems that we need to reduce the square of norm, because: ||x||_2^2 = (x_1^2 + x_2^2) +
(x_3^2 + x_4^2)" (laekov/fastmoe pull request #65, the grad-clip patch all-reducing the norm itself);
"`sqrt(20)` and `sqrt(100)` averaged to 7.236 instead of `sqrt(20 + 100)` ... wherever clipping is active
this changes the update" (deepspeedai/DeepSpeed issue #8469 and pull request #8478, norms combined across
ranks without their squares). Symptom: "with gradient clipping on, the 2-GPU run learns slower than 1 GPU;
without clipping they match; the logged grad norm is larger on 2 GPUs".
Twin: the squares of the local norms are all-reduced and the square root taken (the global L2 norm).
"""

import torch
import torch.distributed as dist
from _base import HEALTHY, build_model, loss_fn, make_batch, shard_batch  # noqa: F401
from torch.distributed.tensor import DTensor

MAX_NORM = 0.3


def _total_norm(grads):
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in local]))
    if not any(isinstance(g, DTensor) for g in grads):
        return norm  # one process: the whole gradient is here
    if HEALTHY:
        squared = norm.pow(2)
        dist.all_reduce(squared)
        return squared.sqrt()
    dist.all_reduce(norm)  # the bug: sums the shards' norms, not their squares
    return norm


def train_step(model, batch, optimizer):
    loss = loss_fn(model, batch)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    coef = torch.clamp(MAX_NORM / (_total_norm(grads) + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    optimizer.step()
    return loss
