"""Bug: gradient accumulation averages the micro-batches' mean token losses (each micro-batch's loss divided by its own valid-token count, then by the number of micro-batches), so a token counts more in a micro-batch with fewer valid tokens and the result depends on how the rows are cut into micro-batches and ranks.

Report: the gradient-accumulation loss bug of October 2024: "In honor of the day the ML community first
discovered the fact that (x1 / n1) + (x2 / n2) != (x1 + x2) / (n1 + n2)" (meta-pytorch/torchtune pull
request #1875); "Gradient accumulation is *supposed* to be mathematically equivalent to full batch training;
however, losses did not match between training runs where the setting was toggled on and off"
(huggingface/blog pull request #2414); per-rank and per-micro-batch normalisation in pytorch/torchtitan pull
request #2206. Symptom: "with variable-length samples, 2 GPUs x 2 micro-batches trains differently from
1 GPU on the same global batch".
Twin: every micro-batch's token-loss sum is divided by the global batch's valid-token count (times the world
size, for FSDP's average), and the micro-batch losses are summed.
"""

import torch.nn.functional as F
from _base import HEALTHY, build_model, loss_fn, make_batch, shard_batch  # noqa: F401

from distdiag.workloads.base import batch_on

MICRO = 2


def _micro_mean(model, part):
    """The micro-batch's mean token loss over its own valid tokens (a model's default `reduction="mean"`)."""
    part = batch_on(model, part)
    tokens, mask = part["tokens"], part["mask"]
    logits = model(tokens[:, :-1])
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none")
    per_token = per_token.view(tokens.shape[0], -1) * mask
    return per_token.sum() / mask.sum()


def train_step(model, batch, optimizer):
    rows = batch["tokens"].shape[0]
    total = 0.0
    for i in range(MICRO):
        part = {k: (v[i * rows // MICRO:(i + 1) * rows // MICRO] if hasattr(v, "shape") and v.dim() else v)
                for k, v in batch.items()}
        if HEALTHY:
            loss = loss_fn(model, part)  # a token-loss sum over the global count: the micro-batch losses add up
        else:
            loss = _micro_mean(model, part) / MICRO  # the bug: a mean of the micro-batches' means
        loss.backward()
        total += float(loss.detach())
    optimizer.step()
    return total
