"""Sequence-parallel building blocks: label shifting, splitters, a tiny causal LM, Ulysses.

Batches follow Hugging Face's convention: a dict with `input_ids` [B, S], `labels` [B, S]
(unshifted, -100 = ignored), optional `position_ids` [B, S] and `attention_mask` [B, S]
(1 = real token). A split hands each rank `shift_labels` already shifted over the whole
sequence: shifting after the split would lose the target of each shard's last token.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distdiag.workloads.base import batch_on

__all__ = [
    "IGNORE_INDEX",
    "shift_labels",
    "contiguous_indices",
    "zigzag_indices",
    "take_positions",
    "contiguous_split",
    "zigzag_split",
    "SPLITTERS",
    "make_lm_batch",
    "TinyCausalLM",
    "sp_loss",
    "parallelize_tiny_lm",
    "attention",
    "seq_to_heads",
    "heads_to_seq",
]

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Targets of every position over the whole sequence: labels[:, p + 1], -100 at the end."""
    out = torch.full_like(labels, IGNORE_INDEX)
    out[:, :-1] = labels[:, 1:]
    return out


def contiguous_indices(seq_len: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank r's positions: the r-th of world_size nearly equal contiguous chunks (first ones +1)."""
    return torch.tensor_split(torch.arange(seq_len), world_size)[rank]


def zigzag_indices(seq_len: int, rank: int, world_size: int) -> torch.Tensor:
    """Load-balanced causal split: chunks r and 2W-1-r of 2W chunks (uneven lengths allowed)."""
    chunks = torch.tensor_split(torch.arange(seq_len), 2 * world_size)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]])


def take_positions(batch: dict[str, torch.Tensor], index: torch.Tensor) -> dict[str, torch.Tensor]:
    """The local batch at these global positions, with targets shifted before the split."""
    ids = batch["input_ids"]
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    out = {
        "input_ids": ids[:, index],
        "shift_labels": shift_labels(batch["labels"])[:, index],
        "position_ids": positions[:, index],
    }
    if batch.get("attention_mask") is not None:
        out["attention_mask"] = batch["attention_mask"][:, index]
    return out


def contiguous_split(batch: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    return take_positions(batch, contiguous_indices(batch["input_ids"].shape[1], rank, world_size))


def zigzag_split(batch: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    return take_positions(batch, zigzag_indices(batch["input_ids"].shape[1], rank, world_size))


SPLITTERS = {"contiguous": contiguous_split, "zigzag": zigzag_split}
"""The built-in splitters, by the name `probes.sequence_parallel.splitter` takes."""


def make_lm_batch(batch_size: int = 2, seq_len: int = 32, vocab: int = 64, *, pad: int = 0, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random LM batch; the last `pad` positions of sample 0 are padding (mask 0, label -100)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=gen)
    labels = ids.clone()
    mask = torch.ones_like(ids)
    if pad:
        labels[0, seq_len - pad :] = IGNORE_INDEX
        mask[0, seq_len - pad :] = 0
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, k_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention by global positions. q [B, H, Sq, D], k/v [B, H, Sk, D], pos [B, S]."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    allowed = q_pos[:, None, :, None] >= k_pos[:, None, None, :]
    if k_mask is not None:
        # A query always sees itself, so a padded query never has an empty row (no NaN).
        same = q_pos[:, None, :, None] == k_pos[:, None, None, :]
        allowed = allowed & (k_mask[:, None, None, :].bool() | same)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


class _GatherSeq(torch.autograd.Function):
    """All-gather along a dim with a backward that keeps this rank's slice of the summed grad."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        world = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        # Every part is empty_like(x): all ranks' slices are x.shape[dim] long.
        ctx.dim, ctx.group, ctx.size = dim, group, x.shape[dim]
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad.narrow(ctx.dim, rank * ctx.size, ctx.size), None, None


class TinyCausalLM(nn.Module):
    """Embedding + learned positions + one attention block + head; sequence-parallel when told.

    In SP mode (`sp_group` set) each rank holds a shard of the sequence; keys and values of
    every shard are all-gathered along `gather_dim` (the sequence dim, 1) so each query sees
    the whole causal prefix by its global position.
    """

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, max_len: int = 256) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, vocab)
        self.sp_group: Any = None
        self.gather_dim = 1

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
        x = self.embed(input_ids) + self.pos(position_ids)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        k_pos, k_mask = position_ids, attention_mask
        if self.sp_group is not None:
            k = _GatherSeq.apply(k, self.gather_dim, self.sp_group)
            v = _GatherSeq.apply(v, self.gather_dim, self.sp_group)
            k_pos = _GatherSeq.apply(position_ids, self.gather_dim, self.sp_group)
            if k_mask is not None:
                k_mask = _GatherSeq.apply(k_mask, self.gather_dim, self.sp_group)

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(t.shape[0], t.shape[1], self.heads, -1).transpose(1, 2)

        out = attention(split(q), split(k), split(v), position_ids, k_pos, k_mask)
        x = x + self.proj(out.transpose(1, 2).reshape(out.shape[0], s, -1))
        x = x + self.mlp(x)
        return self.head(x)


def sp_loss(model: nn.Module, batch: dict[str, torch.Tensor], group: Any = None) -> torch.Tensor:
    """Causal-LM loss on a full batch (labels) or on an SP shard (shift_labels).

    On a shard, the loss this rank backpropagates is its summed token loss times the group
    size over the group's number of valid targets (an all_reduce of counts): the mean over
    ranks is the full batch's loss, and the gradient averaged over ranks (what FSDP/DDP do)
    is the full batch's gradient. Zero valid targets anywhere give 0, not 0/0. The batch is moved
    to the model's device first (docs/targets.md, "Devices").
    """
    batch = batch_on(model, batch)
    logits = model(batch["input_ids"], batch.get("position_ids"), batch.get("attention_mask"))
    targets = batch["shift_labels"] if "shift_labels" in batch else shift_labels(batch["labels"])
    total = nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    count = (targets != IGNORE_INDEX).sum().to(total.dtype)
    world = 1
    if "shift_labels" in batch and dist.is_initialized():
        world = dist.get_world_size(group)
        dist.all_reduce(count, group=group)
    return total * world / count.clamp(min=1)


def parallelize_tiny_lm(model: nn.Module, mesh: Any) -> nn.Module:
    """Put a TinyCausalLM in sequence-parallel mode on the mesh's (only) dimension."""
    model.sp_group = mesh.get_group()
    return model


def seq_to_heads(x: torch.Tensor, world: int, a2a: Any, group: Any = None) -> torch.Tensor:
    """Ulysses: [B, S/W, H, D] sequence-sharded -> [B, S, H/W, D] head-sharded, by one all_to_all."""
    b, s_local, h, d = x.shape
    # Chunk j of the heads goes to rank j: lay the send buffer out as [W, B, S/W, H/W, D].
    send = x.reshape(b, s_local, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    a2a(recv, send, None, None, group=group)
    # recv[j] is rank j's sequence shard of my heads: concatenate along the sequence.
    return recv.permute(1, 0, 2, 3, 4).reshape(b, world * s_local, h // world, d)


def heads_to_seq(x: torch.Tensor, world: int, a2a: Any, group: Any = None) -> torch.Tensor:
    """The inverse of seq_to_heads: [B, S, H/W, D] -> [B, S/W, H, D]."""
    b, s, h_local, d = x.shape
    send = x.reshape(b, world, s // world, h_local, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    a2a(recv, send, None, None, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // world, world * h_local, d)
