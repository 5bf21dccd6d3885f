"""Bug: a sequence classifier pools the hidden state at the last position (`hidden[:, -1]`), and the collator pads each batch to its own longest row (dynamic padding). For rows shorter than the longest, the last position is padding, and how much padding precedes it depends on which rows share the batch: on 2 ranks each rank pads to its own longest row, so the pooled states (and the loss) differ from the single-process run on the whole batch.

Report: "predicted class actually depends on the number of padding tokens added into the sequence"
(rasbt/LLMs-from-scratch issue #566, a classifier that reads the last position); "`BloomForSequenceClassification`
output is sensitive to `padding_side` and `max_length`" (huggingface/transformers issue #24265; pooling the last
non-padding token, transformers issue #35909). Symptom: "the classifier's loss on 2 GPUs differs from 1 GPU on
the same global batch from step 1; with every row the same length they match".
Twin: the classifier pools the state at each row's last real token (`hidden[arange, lengths - 1]`), which the
padding does not change.
"""

import torch
import torch.nn.functional as F
from _base import HEALTHY
from torch import nn

from distdiag.workloads.base import annotate, batch_on, split_batch

VOCAB, DIM, CLASSES, ROWS, MAXLEN, PAD = 20, 16, 3, 8, 10, 0


class Block(nn.Module):
    """A causal token mixer (the running mean of the positions so far), then an MLP, both residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        h = self.norm(x)
        running = h.cumsum(1) / torch.arange(1, h.shape[1] + 1, device=h.device)[None, :, None]
        x = x + self.mix(running)
        return x + self.mlp(x)


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)  # per-position class scores; loss_fn pools one position


def build_model():
    return Classifier()


def make_batch(step):
    gen = torch.Generator().manual_seed(1200 + step)
    lengths = torch.randint(2, MAXLEN, (ROWS,), generator=gen)
    lengths[-1] = MAXLEN  # padded to the global batch's longest row
    tokens = torch.randint(1, VOCAB, (ROWS, MAXLEN), generator=gen)
    tokens[torch.arange(MAXLEN)[None, :] >= lengths[:, None]] = PAD
    return {"tokens": tokens, "lengths": lengths, "labels": torch.randint(0, CLASSES, (ROWS,), generator=gen)}


def shard_batch(batch, rank, world_size):
    part = annotate(split_batch(batch, rank, world_size), world_size, ROWS)
    part["tokens"] = part["tokens"][:, :int(part["lengths"].max())]  # dynamic padding: this batch's longest row
    return part


def loss_fn(model, batch):
    batch = batch_on(model, batch)
    scores = model(batch["tokens"])
    if HEALTHY:
        pooled = scores[torch.arange(scores.shape[0], device=scores.device), batch["lengths"] - 1]
    else:
        pooled = scores[:, -1]  # the bug: the last position, padding for every row but the longest
    return F.cross_entropy(pooled, batch["labels"], reduction="sum") * batch["world_size"] / batch["global_count"]
