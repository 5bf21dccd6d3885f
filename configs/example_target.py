"""An example distdiag target: every hook, on a small causal language model.

Run the numerical probes on it (from the repository root):

    torchrun --nproc-per-node 2 -m distdiag.check --target configs/example_target.py \
        --probes fsdp_plan,loss_parity,param_sync,determinism

Semantics (docs/targets.md): distdiag seeds every rank identically before each hook call.
The reference runs these hooks in one process on the unsharded model and the whole global
batch (shard_batch(batch, 0, 1)); the parallel run calls them on every rank with its shard
(shard_batch(batch, rank, world_size)) on the model returned by parallelize. Hooks must not
issue collectives themselves (the reference calls them too); what parallelize sets up
(FSDP2's reduce-scatter, clip_grad_norm_ over DTensors) is the parallel run's business.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

VOCAB, DIM, LAYERS, SEQ, BATCH, MICRO = 64, 32, 2, 16, 8, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, num_heads=4, batch_first=True, dropout=0.0)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)  # on x's device: the GPU
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model() -> nn.Module:
    """The model, as training builds it (distdiag seeded the RNG just before)."""
    return TinyLM()


def make_batch(step: int) -> dict:
    """The GLOBAL batch of this step, identical on every rank: here padded rows of varied length."""
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    lengths = torch.randint(2, SEQ + 1, (BATCH,), generator=gen)
    mask = torch.arange(SEQ)[None, :] < lengths[:, None]
    return {"tokens": tokens, "mask": mask}


def shard_batch(batch: dict, rank: int, world_size: int) -> dict:
    """This rank's rows, annotated with what the loss needs to normalise by the GLOBAL batch."""
    per = batch["tokens"].shape[0] // world_size
    rows = slice(rank * per, (rank + 1) * per)
    return {
        "tokens": batch["tokens"][rows],
        "mask": batch["mask"][rows],
        "global_tokens": int(batch["mask"].sum()),
        "world_size": world_size,
    }


def _token_loss_sum(model: nn.Module, batch: dict) -> torch.Tensor:
    logits = model(batch["tokens"][:, :-1])
    per_token = F.cross_entropy(logits.reshape(-1, VOCAB), batch["tokens"][:, 1:].reshape(-1), reduction="none")
    return (per_token * batch["mask"].reshape(-1)).sum()


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    """The loss this rank backpropagates: token-loss sum over the global token count, times the
    world size, because FSDP2 averages gradients over ranks."""
    return _token_loss_sum(model, batch) * batch["world_size"] / batch["global_tokens"]


def parallelize(model: nn.Module, mesh) -> nn.Module:
    """FSDP2 per block, then the root (which takes embed, norm and head); fp32 reduction."""
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def build_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def train_step(model: nn.Module, batch: dict, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Two micro-batches accumulated as token sums (not averaged means), then clipping and a step."""
    per = batch["tokens"].shape[0] // MICRO
    total = torch.zeros((), device=batch["tokens"].device)  # the batch comes on the model's device (docs/targets.md)
    for i in range(MICRO):
        micro = {**batch, "tokens": batch["tokens"][i * per : (i + 1) * per], "mask": batch["mask"][i * per : (i + 1) * per]}
        loss = _token_loss_sum(model, micro) * batch["world_size"] / batch["global_tokens"]
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    optimizer.step()
    return total
