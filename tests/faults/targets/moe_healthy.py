"""Healthy MoE target: a deterministic router, an expert-parallel model with one capacity everywhere."""

import torch
import torch.distributed as dist

from distdiag.workloads.moe import DenseMoE, ExpertParallelMoE

DIM = 16
_ROUTER = torch.nn.Linear(DIM, 4, bias=False)
torch.nn.init.normal_(_ROUTER.weight, generator=torch.Generator().manual_seed(3))


def route(tokens):
    scores = torch.softmax(_ROUTER(tokens), dim=-1)
    return scores.topk(2, dim=-1).indices, scores


def capacity(rank):
    return 16


def build_model():
    dense = DenseMoE(DIM, 32, num_experts=2 * dist.get_world_size(), k=2)
    rank, world = dist.get_rank(), dist.get_world_size()
    return ExpertParallelMoE.from_dense(dense, rank, world, capacity=capacity(rank))


def make_batch(step):
    return torch.randn(8 * dist.get_world_size(), DIM, generator=torch.Generator().manual_seed(step))


def shard_batch(batch, rank, world_size):
    return batch.chunk(world_size)[rank]


def loss_fn(model, batch):
    return model(batch).pow(2).mean()
