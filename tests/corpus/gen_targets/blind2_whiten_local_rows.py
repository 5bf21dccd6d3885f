"""Bug: a reward-weighted (policy-gradient style) loss whitens each row's reward with the mean and std of the rows this rank holds, not of the global batch.

Report: advantages whitened with per-rank statistics instead of the whole batch's (THUDM/slime pull
request #2235: "advantages are whitened with per-CP-rank statistics instead of global ones";
radixark/miles pull request #3229: "whitens every CP slice of the same batch with its own mean/variance").
Symptom: "the 2-GPU run's loss and updates differ from 1 GPU from the first step".
Twin: the mean and std of the global batch's rewards, annotated by shard_batch (what an all_reduce gives).
"""

import torch
import torch.nn.functional as F
from _base import HEALTHY, build_model  # noqa: F401
from _base import make_batch as _make_batch
from _base import shard_batch as _shard_batch

from distdiag.workloads.base import batch_on


def make_batch(step):
    batch = _make_batch(step)
    gen = torch.Generator().manual_seed(900 + step)
    batch["reward"] = torch.randn(batch["tokens"].shape[0], generator=gen) + torch.arange(batch["tokens"].shape[0]) * 0.3
    return batch


def shard_batch(batch, rank, world_size):
    part = _shard_batch(batch, rank, world_size)
    part["reward_mean"], part["reward_std"] = float(batch["reward"].mean()), float(batch["reward"].std())
    return part


def loss_fn(model, batch):
    batch = batch_on(model, batch)
    tokens, mask, reward = batch["tokens"], batch["mask"], batch["reward"]
    if HEALTHY:
        adv = (reward - batch["reward_mean"]) / (batch["reward_std"] + 1e-6)
    else:
        adv = (reward - reward.mean()) / (reward.std() + 1e-6)  # the bug: this rank's rows only
    logits = model(tokens[:, :-1])
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none")
    weighted = per_token.view(tokens.shape[0], -1) * mask * adv[:, None]
    return weighted.sum() * batch["world_size"] / batch["global_count"]
