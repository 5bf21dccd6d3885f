"""Bug: the loss adds a z-loss (the squared log-partition of the logits) as an auxiliary term and averages it with `.mean()` over this rank's valid tokens, while the main cross-entropy is a token sum over the global batch's count (times the world size, for FSDP's average). Only the auxiliary term is normalised per rank: with ranks holding different numbers of valid tokens, the ranks' tokens weigh differently in it than in the single-process run.

Report: "The loss normalization in ... bagel.py uses local token counts instead of global token counts
across all GPUs ... The dist.all_reduce calls are commented out" for the auxiliary MSE term next to the
globally normalised cross-entropy (EvolvingLMMs-Lab/lmms-engine issue #133); "Add zloss" next to the
cross-entropy (foundation-model-stack/fms-fsdp pull request #136); per-rank versus global token
normalisation (verl-project/verl pull request #3994). Symptom: "the 2-GPU loss differs slightly from 1 GPU
from step 1, more on batches of uneven lengths; without the z-loss they match".
Twin: the z-loss is a token sum over the global valid count times the world size, like the cross-entropy.
"""

import torch.nn.functional as F
from _base import HEALTHY, build_model, make_batch, shard_batch  # noqa: F401

from distdiag.workloads.base import batch_on

Z_WEIGHT = 0.05


def loss_fn(model, batch):
    batch = batch_on(model, batch)
    tokens, mask = batch["tokens"], batch["mask"].float()
    logits = model(tokens[:, :-1])
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none")
    scale = batch["world_size"] / batch["global_count"]
    ce = (per_token.view(tokens.shape[0], -1) * mask).sum() * scale
    z = logits.logsumexp(-1).pow(2)
    if HEALTHY:
        z_term = (z * mask).sum() * scale
    else:
        z_term = (z * mask).sum() / mask.sum()  # the bug: a mean over this rank's valid tokens
    return ce + Z_WEIGHT * z_term
