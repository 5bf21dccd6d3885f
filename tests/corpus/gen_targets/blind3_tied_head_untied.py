"""Bug: parallelize uses deferred (meta-device) init for a model whose output head is tied to its embedding: built on meta, `to_empty`, filled from the checkpoint, then sharded. `to_empty` gives every parameter its own storage, so `head.weight` stops aliasing `embed.weight`: the values load right, but from then on the embedding gets only the input side of its gradient and the head trains as a separate matrix.

Report: "to_empty() gives every parameter fresh storage, so a tied lm_head stops aliasing the embedding.
Nothing fails when that happens ... but the embedding then receives only the input-side half of its
gradient" (verl-project/verl issue #7834, fix pull request #7835: re-tie after to_empty); "when training
with FSDP the way we initialize the model undoes the weight tying ... I suspect it's because we initialize
on meta device" (meta-pytorch/torchtune issue #616, Gemma). Symptom: "the 2-GPU run of a tied-embedding
model drifts from 1 GPU after the first step; the loss at step 1 matches; after saving, embed and lm_head
differ".
Twin: the same meta-device path, with the head tied to the embedding again right after `to_empty` (before
the checkpoint is loaded and the model sharded), as the fix does.
"""

import torch
import torch.nn.functional as F
from _base import HEALTHY
from torch import nn
from torch.distributed.fsdp import fully_shard

from distdiag.workloads.base import annotate, batch_on, split_batch

VOCAB, DIM, SEQ, ROWS = 32, 16, 8, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.tie_weights()

    def tie_weights(self):
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_model():
    return TiedLM()


def parallelize(model, mesh):
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}  # the checkpoint every rank loads
    with torch.device("meta"):
        model = TiedLM()  # deferred init: no memory until the weights are loaded
    model.to_empty(device="cpu")  # the bug: fresh storage for head.weight and for embed.weight
    if HEALTHY:
        model.tie_weights()  # the fix: tie again after to_empty, before loading and sharding
    model.load_state_dict(full)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def make_batch(step):
    gen = torch.Generator().manual_seed(400 + step)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=gen)
    return {"tokens": tokens}


def shard_batch(batch, rank, world_size):
    return annotate(split_batch(batch, rank, world_size), world_size, ROWS * SEQ)


def loss_fn(model, batch):
    batch = batch_on(model, batch)
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    total = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), reduction="sum")
    return total * batch["world_size"] / batch["global_count"]
