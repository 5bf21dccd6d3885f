"""Bug: an aux-loss-free load-balancing router (a bias added to the scores before top-k, nudged
each step towards the under-loaded experts, as DeepSeek-V3 does) updates its bias from this
rank's own expert load. Each rank's bias drifts its own way, and after a step the ranks route the
same tokens to different experts. Twin: the load summed over every rank before the update."""

import torch
import torch.distributed as dist
from _twin import HEALTHY
from torch import nn

DIM, EXPERTS, K = 16, 4, 2


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, EXPERTS, bias=False)
        nn.init.normal_(self.proj.weight, generator=torch.Generator().manual_seed(3))
        self.register_buffer("expert_bias", torch.zeros(EXPERTS))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(self.proj(x))
        idx = (scores + self.expert_bias).topk(K, dim=-1).indices
        if self.training:
            with torch.no_grad():
                load = torch.bincount(idx.reshape(-1), minlength=EXPERTS).float()
                if HEALTHY and dist.is_initialized():
                    dist.all_reduce(load)
                self.expert_bias += 0.5 * torch.sign(load.mean() - load)
        return idx, scores


GATE = Gate()


def route(tokens: torch.Tensor):
    GATE.eval()
    try:
        with torch.no_grad():
            return GATE(tokens)
    finally:
        GATE.train()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = GATE
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, scores = self.gate(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            weight = (idx == e).any(-1).float() * scores[:, e]
            out = out + weight[:, None] * expert(x)
        return out


def build_model() -> nn.Module:
    torch.manual_seed(1234)
    return Net()


def make_batch(step: int) -> torch.Tensor:
    return torch.randn(8 * dist.get_world_size(), DIM, generator=torch.Generator().manual_seed(step))


def shard_batch(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return batch.chunk(world_size)[rank]


def loss_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()
