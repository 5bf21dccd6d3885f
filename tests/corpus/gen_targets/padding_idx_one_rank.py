"""Bug: the embedding's padding_idx (the pad token, the vocabulary's last id) comes from the tokenizer, loaded on rank 0 only.

Rank 0 builds nn.Embedding(padding_idx=pad) (the pad row zero, its gradient masked), the other ranks
without it. Report: "the pad embedding is not zero after init on the multi-GPU run and gets updates".
Twin: every rank builds the embedding with padding_idx=pad.
"""

import torch
from _base import HEALTHY, RANK, loss_fn, make_batch, shard_batch, workload  # noqa: F401


def build_model():
    model = workload.build_model()
    pad = model.embed.num_embeddings - 1
    if HEALTHY or RANK == 0:  # nn.Embedding(padding_idx=pad) zeroes that row at init and masks its gradient
        with torch.no_grad():
            model.embed.weight[pad].zero_()
        model.embed.padding_idx = pad
    return model
