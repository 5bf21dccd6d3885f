"""A raise in a nested helper. --mode fault_all: every rank raises the same error at step --at
(a bad batch shape in the collate helper). --mode fault: only rank --rank (default 1) raises
(its shard holds the bad record). Truth: the ranks that raised."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.distributed as dist
from _common import args, compute, done, init, model

a = args()
rank, world = init()
bad = a.rank if a.rank >= 0 else 1


def check_record(step, r):
    if step == a.at and (a.mode == "fault_all" or (a.mode == "fault" and r == bad)):
        raise ValueError(f"record {1000 + step} has 15 features, expected 16 (rank {r})")


def collate(step, r):
    check_record(step, r)
    return torch.randn(8, 16)


def next_batch(step, r):
    return collate(step, r)


m, opt = model(0)
for step in range(a.steps):
    compute(20)
    m(next_batch(step, rank)).pow(2).mean().backward()
    for p in m.parameters():
        dist.all_reduce(p.grad)
    opt.step(); opt.zero_grad()
done()
