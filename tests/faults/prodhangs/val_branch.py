"""Validation loss reduced to rank 0 with dist.reduce: only rank 0 holds the global value, so only
rank 0 takes `if val < best: save()`, and the save all_gathers (a sharded state's metadata).
--mode fault: the branch as written (rank 0 alone saves, the first time val improves, at --at);
--mode healthy: the loss all_reduced, every rank takes the branch."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.distributed as dist
from _common import args, compute, done, init, model

a = args()
rank, world = init()
m, opt = model(0)
best = float("inf")


def save(step):
    meta = [None] * world
    dist.all_gather_object(meta, {"rank": rank, "step": step, "n": sum(p.numel() for p in m.parameters())})
    if rank == 0:
        torch.save(m.state_dict(), os.path.join(os.getcwd(), f"ckpt_{step}.pt"))


for step in range(a.steps):
    compute(20)
    m(torch.randn(8, 16)).pow(2).mean().backward()
    for p in m.parameters():
        dist.all_reduce(p.grad)
    opt.step(); opt.zero_grad()
    with torch.no_grad():
        val = torch.tensor([1.0 if (rank == 0 and step >= a.at) else 100.0])  # rank 0 sees the improvement
    if a.mode == "fault":
        dist.reduce(val, dst=0)   # the bug: only rank 0 holds the sum
    else:
        dist.all_reduce(val)
    if val.item() < best:        # rank-dependent on every rank but 0 (their val is their own)
        best = val.item()
        save(step)
done()
