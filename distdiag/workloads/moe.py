"""A tiny top-k mixture-of-experts layer: dense reference and expert-parallel dispatch.

`DenseMoE` holds a router and every expert and computes the layer on one process.
`ExpertParallelMoE.from_dense(dense, rank, world)` keeps the router (replicated) and this
rank's `num_experts / world` experts, and moves tokens with two all_to_all_single calls
(GShard-style fixed-capacity buffers: every (rank -> rank) chunk is `local_experts x
capacity` rows, so split sizes are equal and known in advance). Assignments beyond an
expert's capacity are dropped the same way in both layers (`keep_mask`), so the two
outputs agree exactly up to float summation order.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["TopKRouter", "Expert", "DenseMoE", "ExpertParallelMoE", "keep_mask", "capacity_for"]


class TopKRouter(nn.Module):
    """Linear scores -> softmax -> top-k experts with renormalised gates."""

    def __init__(self, dim: int, num_experts: int, k: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.k = k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indices [N, k], gates [N, k], scores [N, E])."""
        scores = torch.softmax(self.gate(x).float(), dim=-1)
        top, idx = scores.topk(self.k, dim=-1)
        return idx, (top / top.sum(-1, keepdim=True)).to(x.dtype), scores


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def capacity_for(num_tokens: int, k: int, num_experts: int, factor: float) -> int:
    """Slots per expert and source rank: ceil(factor x tokens x k / experts)."""
    return max(1, math.ceil(factor * num_tokens * k / num_experts))


def slots(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[N, k]: each assignment's place in its expert's queue (0 = first).

    Order: token-major, then choice (token 0 choice 0, token 0 choice 1, token 1 ...).
    """
    onehot = nn.functional.one_hot(idx.reshape(-1), num_experts)
    return ((onehot.cumsum(0) * onehot).sum(-1) - 1).reshape(idx.shape)


def keep_mask(idx: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """[N, k] bool: an assignment is kept if it is among its expert's first `capacity`."""
    return slots(idx, num_experts) < capacity


class DenseMoE(nn.Module):
    """The single-process reference: router and every expert."""

    def __init__(self, dim: int = 16, hidden: int = 32, num_experts: int = 4, k: int = 2, capacity_factor: float = 2.0) -> None:
        super().__init__()
        self.router = TopKRouter(dim, num_experts, k)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(num_experts))
        self.num_experts, self.k, self.capacity_factor = num_experts, k, capacity_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, gates, _ = self.router(x)
        keep = keep_mask(idx, self.num_experts, capacity_for(x.shape[0], self.k, self.num_experts, self.capacity_factor))
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, choice = ((idx == e) & keep).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * gates[token, choice, None])
        return out


class ExpertParallelMoE(nn.Module):
    """This rank's experts; tokens dispatched over all_to_all with fixed-capacity buffers.

    `stats` holds what the last forward sent and received: rows per peer, valid (non-empty)
    rows per peer, capacity, dropped assignments, tokens per expert, and whether every sent
    token came back exactly once.
    """

    def __init__(self, router: TopKRouter, experts: list[nn.Module], num_experts: int, rank: int, world: int,
                 capacity_factor: float = 2.0, capacity: int | None = None, a2a: Any = None, group: Any = None) -> None:
        super().__init__()
        if num_experts % world:
            raise ValueError(f"num_experts ({num_experts}) must divide by the expert-parallel world size ({world})")
        self.router = router
        self.experts = nn.ModuleList(experts)
        self.num_experts, self.rank, self.world = num_experts, rank, world
        self.local = num_experts // world
        self.capacity_factor = capacity_factor
        self.capacity = capacity
        """Fixed slots per expert and source rank; None: computed from the token count."""
        self.a2a = a2a
        """The all_to_all_single to use; None: torch.distributed's, looked up at each call."""
        self.group = group
        self.stats: dict[str, Any] = {}

    @classmethod
    def from_dense(cls, dense: DenseMoE, rank: int, world: int, **kw: Any) -> ExpertParallelMoE:
        local = dense.num_experts // world
        experts = [copy.deepcopy(dense.experts[rank * local + i]) for i in range(local)]
        return cls(copy.deepcopy(dense.router), experts, dense.num_experts, rank, world,
                   capacity_factor=dense.capacity_factor, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, d = x.shape
        k = self.router.k
        idx, gates, _ = self.router(x)
        cap = self.capacity if self.capacity is not None else capacity_for(n, k, self.num_experts, self.capacity_factor)
        slot_all = slots(idx, self.num_experts)
        keep = slot_all < cap  # keep_mask, with the slots kept for the send buffer below
        # Send buffer [experts, capacity, d] in expert order = [peer, local expert, slot].
        buf = x.new_zeros(self.num_experts * cap, d)
        token_of = torch.full((self.num_experts * cap,), -1, dtype=torch.long, device=x.device)
        token, choice = keep.nonzero(as_tuple=True)
        expert = idx[token, choice]
        rows = expert * cap + slot_all[token, choice]
        buf[rows] = x[token]
        gid = self.rank * n + token  # the token's global id travels with it
        token_of[rows] = gid
        chunk = self.local * cap
        splits = [chunk] * self.world
        recv = torch.empty_like(buf)
        recv_ids = torch.empty_like(token_of)
        a2a = self.a2a or dist.all_to_all_single
        a2a(recv, buf, splits, splits, group=self.group)
        a2a(recv_ids, token_of, splits, splits, group=self.group)
        # recv rows: [source peer, local expert, slot].
        y = torch.zeros_like(recv)
        view_in = recv.view(self.world, self.local, cap, d)
        view_out = y.view(self.world, self.local, cap, d)
        valid = (recv_ids >= 0).view(self.world, self.local, cap)
        for e, exp in enumerate(self.experts):
            rows_e = valid[:, e].nonzero(as_tuple=True)
            if rows_e[0].numel():
                view_out[:, e][rows_e] = exp(view_in[:, e][rows_e])
        back = torch.empty_like(y)
        back_ids = torch.empty_like(recv_ids)
        a2a(back, y, splits, splits, group=self.group)
        a2a(back_ids, recv_ids, splits, splits, group=self.group)
        out = torch.zeros_like(x)
        out.index_add_(0, token, back[rows] * gates[token, choice, None])
        sent_valid = (token_of >= 0).view(self.world, chunk).sum(1)
        recv_valid = (recv_ids >= 0).view(self.world, chunk).sum(1)
        self.stats = {
            "capacity": cap,
            "sent_valid": sent_valid.tolist(),
            "recv_valid": recv_valid.tolist(),
            "assignments": n * k,
            "dropped": int((~keep).sum()),
            "tokens_per_expert": torch.bincount(idx.reshape(-1), minlength=self.num_experts).tolist(),
            "round_trip_ok": bool(torch.equal(back_ids, token_of)),
        }
        return out
