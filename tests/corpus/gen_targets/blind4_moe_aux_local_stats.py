"""Bug: a mixture-of-experts language model adds the Switch-style load-balancing loss E x sum_e f_e x P_e, with f_e (the share of tokens routed to expert e) and P_e (the mean router probability of e) computed over this rank's tokens only. The loss is a product of two batch means, so the ranks' local balancing losses do not average to the global batch's: the 2-rank run balances each rank's micro-batch, the single-process run the global batch.

Report: "Implement global-batch level load balancing" (NVIDIA/Megatron-LM issue #1498, citing "Demons in the
Detail: On Implementing Load Balancing Loss for Training Specialized Mixture-of-Expert Models", arXiv
2501.11873: the balancing loss computed per micro-batch, i.e. per device, instead of over the global batch);
"Add global batch-wise MoE auxiliary loss" (pytorch/torchtitan pull request #4772); "MoE - Add global batch
load balancing loss" (microsoft/ltp-megatron-lm pull request #7). Symptom: "the MoE run on 2 GPUs differs from
1 GPU on the same global batch from step 1; without the balancing loss they match".
Twin: the routing counts are all-reduced over the ranks (f over the global batch, no gradient), and each rank
adds its tokens' share of E x sum_e f_e x P_e (their probabilities summed over the global token count, times
the world size for FSDP's average): the global batch's balancing loss, as the fix does.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _base import HEALTHY
from torch import nn
from torch.distributed.fsdp import fully_shard

from distdiag.workloads.base import annotate, batch_on, split_batch

VOCAB, DIM, EXPERTS, ROWS, SEQ, AUX = 24, 16, 4, 8, 8, 0.5


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
                                     for _ in range(EXPERTS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        probs = self.router(x).softmax(-1)
        top = probs.argmax(-1)
        gate = probs * F.one_hot(top, EXPERTS)  # top-1 routing, every expert run densely
        x = x + sum(gate[..., e:e + 1] * expert(x) for e, expert in enumerate(self.experts))
        return self.head(self.norm(x)), probs, top


def build_model():
    return MoE()


def parallelize(model, mesh):
    for expert in model.experts:
        fully_shard(expert, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def make_batch(step):
    gen = torch.Generator().manual_seed(1100 + step)
    return {"tokens": torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=gen)}


def shard_batch(batch, rank, world_size):
    return annotate(split_batch(batch, rank, world_size), world_size, ROWS * SEQ)


def loss_fn(model, batch):
    batch = batch_on(model, batch)
    tokens, world, count = batch["tokens"], batch["world_size"], batch["global_count"]
    logits, probs, top = model(tokens[:, :-1])
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), reduction="sum") * world / count
    probs, top = probs.reshape(-1, EXPERTS), top.reshape(-1)
    routed = torch.bincount(top, minlength=EXPERTS).float()
    if HEALTHY:
        if world > 1:
            dist.all_reduce(routed)  # the global batch's routing counts (no gradient through them)
        aux = EXPERTS * (routed / count * probs.sum(0) / count).sum() * world
    else:
        aux = EXPERTS * (routed / routed.sum() * probs.mean(0)).sum()  # the bug: this rank's tokens only
    return ce + AUX * aux
